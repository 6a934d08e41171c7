"""`python -m tools.make_video_goldens`: the tool is tools.regen.make_video_goldens."""
import sys

from tools.regen.make_video_goldens import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
