"""A bare Flask relay to llama-server, run under the same gunicorn settings as kvproxy.

It does nothing but forward the request body and return the answer, so its
added latency is the floor for any Flask + gunicorn + requests proxy on this
machine: the benchmark reports it next to kvproxy's overhead.
"""
from __future__ import annotations

import os
import threading

import requests
from flask import Flask, Response, request

app = Flask(__name__)
UPSTREAM = os.environ.get("KVPROXY_UPSTREAM", "http://127.0.0.1:8080").rstrip("/")
_local = threading.local()


def _http() -> requests.Session:
    if not hasattr(_local, "session"):
        _local.session = requests.Session()
        _local.session.trust_env = False  # as kvproxy: no proxy-variable lookup per call
    return _local.session


@app.get("/health")
def health() -> Response:
    return Response("ok", mimetype="text/plain")


@app.post("/v1/chat/completions")
def chat() -> Response:
    answer = _http().post(UPSTREAM + "/v1/chat/completions", data=request.get_data(),
                          headers={"Content-Type": "application/json"}, timeout=(5, 120),
                          allow_redirects=False)
    return Response(answer.content, status=answer.status_code, mimetype="application/json")
