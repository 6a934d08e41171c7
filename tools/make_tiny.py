"""`python -m tools.make_tiny`: the command's name since it was a module here; the tool is tools.regen.make_tiny."""
import sys

from tools.regen.make_tiny import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
