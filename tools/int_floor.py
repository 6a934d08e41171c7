"""`python -m tools.int_floor`: the command's name since it was a module here; the tool is tools.bench.int_floor."""
import sys

from tools.bench.int_floor import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
