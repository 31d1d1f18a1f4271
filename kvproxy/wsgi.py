"""The WSGI app for gunicorn (``kvproxy serve``; ``wsgi.py`` of the checkout imports it).

Start-up sweeps the slot folder and checks the contract with llama-server; a
bad setting or a mismatch stops it with one line naming the fix.
"""
import sys

from kvproxy import create_app
from kvproxy.config import ConfigError
from kvproxy.ops.startup import check_at_start

# gunicorn's "App failed to load" exit code: the master stops instead of booting workers forever.
APP_LOAD_ERROR = 4

try:
    app = create_app()
    check_at_start(app)
except ConfigError as exc:
    sys.stderr.write(f"kvproxy: {exc}\n")
    sys.exit(APP_LOAD_ERROR)
