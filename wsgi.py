"""WSGI entry point: ``gunicorn -c gunicorn.conf.py wsgi:app``."""
import sys

from kvproxy import create_app
from kvproxy.config import ConfigError

try:
    app = create_app()
except ConfigError as exc:
    sys.stderr.write(f"kvproxy: {exc}\n")
    sys.exit(2)
