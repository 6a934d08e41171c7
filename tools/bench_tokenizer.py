"""`python -m tools.bench_tokenizer`: the command's name since it was a module here; the tool is tools.bench.tokenizer."""
import sys

from tools.bench.tokenizer import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
