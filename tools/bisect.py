"""`python -m tools.bisect`: the command's name since it was a module here; the tool is tools.parity.bisect."""
import sys

from tools.parity.bisect import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
