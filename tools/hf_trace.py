"""`python -m tools.hf_trace`: the command's name since it was a module here; the tool is tools.parity.hf_trace."""
import sys

from tools.parity.hf_trace import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
