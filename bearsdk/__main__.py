"""``python -m bearsdk``: the command line."""

import sys

from bearsdk.cli import main

sys.exit(main())
