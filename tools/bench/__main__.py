import sys

from tools.bench.forward import main

sys.exit(main(sys.argv[1:]))
