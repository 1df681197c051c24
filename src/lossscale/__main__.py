"""`python -m lossscale`: the same command line as the `lossscale` script."""

import sys

from lossscale.cli import main

if __name__ == "__main__":
    sys.exit(main())
