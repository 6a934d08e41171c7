"""`python -m tools.bench_accel`: the command's name since it was a module here; the tool is tools.bench.accel."""
import sys

from tools.bench.accel import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
