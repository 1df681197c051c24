"""`python -m lossscale.bench`: the same as `lossscale bench`."""

import sys

from lossscale.bench import main

sys.exit(main())
