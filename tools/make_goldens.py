"""`python -m tools.make_goldens`: the command's name since it was a module here; the tool is tools.regen.make_goldens."""
import sys

from tools.regen.make_goldens import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
