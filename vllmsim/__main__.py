"""`python -m vllmsim` runs the same command as the `vllmsim` console script."""

import sys

from vllmsim.cli import main

sys.exit(main())
