"""WSGI entry point of the checkout: ``gunicorn -c gunicorn.conf.py wsgi:app``.

The app is the package's (kvproxy/wsgi.py): start-up sweeps the slot folder and checks the
contract with llama-server; a bad setting or a mismatch stops it with one line naming the fix.
"""
from kvproxy.wsgi import APP_LOAD_ERROR, app  # noqa: F401
