"""``python -m kvproxy``: the operator's command line (see kvproxy/cli.py)."""
import sys

from .cli import main

sys.exit(main())
