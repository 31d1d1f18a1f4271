"""gunicorn settings for ``gunicorn wsgi:app`` from the checkout: those of the package
(kvproxy/gunicorn_conf.py, also what ``kvproxy serve`` runs with), read from the
environment each time this file is read."""
import importlib

import kvproxy.gunicorn_conf

globals().update({name: value for name, value in
                  vars(importlib.reload(kvproxy.gunicorn_conf)).items()
                  if not name.startswith("_")})
