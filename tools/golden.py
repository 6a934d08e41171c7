"""`python -m tools.golden`: the command's name since it was a module here; the tool is tools.parity.golden."""
import sys

from tools.parity.golden import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
