"""`python -m tools.make_output_rows_golden`: the command's name since it was a module here; the tool is tools.regen.make_output_rows_golden."""
import sys

from tools.regen.make_output_rows_golden import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
