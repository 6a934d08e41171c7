"""`python -m tools.hf_to_gguf`: the command's name since it was a module here; the tool is tools.regen.hf_to_gguf."""
import sys

from tools.regen.hf_to_gguf import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
