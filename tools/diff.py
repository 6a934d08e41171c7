"""`python -m tools.diff`: the command's name since it was a module here; the tool is tools.parity.diff."""
import sys

from tools.parity.diff import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
