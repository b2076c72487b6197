"""``python -m bearsdk``: the command line."""

import sys

try:
    from bearsdk.cli import main
except KeyboardInterrupt:
    # Ctrl-C while the command line loads: the same one line as later on.
    print("bearsdk: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
