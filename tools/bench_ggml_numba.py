"""`python -m tools.bench_ggml_numba`: the command's name since it was a module here; the tool is tools.bench.ggml_numba."""
import sys

from tools.bench.ggml_numba import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
