"""``python -m kvproxy``: the operator's command line (see kvproxy/ops/cli.py)."""
import sys

from kvproxy.ops.cli import main

sys.exit(main())
