"""`python -m tools.video_mmproj`: the tool is tools.regen.video_mmproj."""
import sys

from tools.regen.video_mmproj import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
