"""``python -m bearsdk``: the command line."""

import sys

from bearsdk._sigint import redeliver_lost_interrupts

redeliver_lost_interrupts()  # before the command line loads: its imports are exposed too
try:
    from bearsdk.cli import main
except KeyboardInterrupt:
    # Ctrl-C while the command line loads: the same one line as later on.
    print("bearsdk: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
