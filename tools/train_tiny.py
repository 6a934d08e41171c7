"""`python -m tools.train_tiny`: the command's name since it was a module here; the tool is tools.regen.train_tiny."""
import sys

from tools.regen.train_tiny import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
