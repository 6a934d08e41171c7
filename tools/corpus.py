"""`python -m tools.corpus`: the name it had as a module here; corpus mode is tools.parity.corpus, run by
`python -m tools.golden ... --corpus`, and this command says so."""
import runpy

if __name__ == "__main__":
    runpy.run_module("tools.parity.corpus", run_name="__main__", alter_sys=True)
