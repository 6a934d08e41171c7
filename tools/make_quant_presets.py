"""`python -m tools.make_quant_presets`: the command's name since it was a module here; the tool is tools.regen.make_quant_presets."""
import sys

from tools.regen.make_quant_presets import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
