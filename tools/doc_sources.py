"""`python -m tools.doc_sources`: the command's name since it was a module here; the tool is tools.regen.doc_sources."""
import sys

from tools.regen.doc_sources import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
