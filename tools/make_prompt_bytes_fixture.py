"""`python -m tools.make_prompt_bytes_fixture`: the command's name since it was a module here; the tool is tools.regen.make_prompt_bytes_fixture."""
import sys

from tools.regen.make_prompt_bytes_fixture import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
