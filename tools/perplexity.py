"""`python -m tools.perplexity`: the command's name since it was a module here; the tool is tools.parity.perplexity."""
import sys

from tools.parity.perplexity import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
