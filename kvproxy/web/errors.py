"""Unknown routes, wrong methods and crashes answer in the API family the path belongs to.

flask-smorest installs an app-wide handler with its own error shape; the
admin API keeps it, every client API gets its own.
"""
from __future__ import annotations

import logging

from flask import Flask, request
from werkzeug.exceptions import HTTPException

from kvproxy.web import anthropic, ollama, openai
from kvproxy.web.common import free_held_slot

log = logging.getLogger("kvproxy.errors")

ANTHROPIC_PATHS = ("/v1/messages", "/messages")
# llama-server's own routes answer errors in OpenAI's shape, as llama-server does.
OPENAI_PATHS = ("/v1/", "/chat/", "/completion", "/models", "/embedding", "/responses",
                "/infill", "/rerank", "/tokenize", "/detokenize", "/apply-template", "/props",
                "/slots", "/lora-adapters", "/audio/")
ADMIN_PATHS = ("/api/sessions", "/api/status", "/api/openapi")


def renderer_for(path: str):
    """The error renderer of the API family a path belongs to (Ollama owns the rest)."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic.render_error
    if path.startswith(OPENAI_PATHS):
        return openai.render_error
    return ollama.render_error


def init_app(app: Flask, api) -> None:
    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        if request.path.startswith(ADMIN_PATHS):
            return api.handle_http_exception(exc)
        status = exc.code or 500
        if status == 500:
            free_held_slot()
        message = exc.description if status != 500 else "internal error in kvproxy; see its log"
        headers = {"Allow": exc.valid_methods and ", ".join(exc.valid_methods)} \
            if status == 405 else {}
        if status == 413:  # the unread rest of the body must not be taken for a next request
            headers["Connection"] = "close"
        return renderer_for(request.path)(status, f"{request.method} {request.path}: {message}",
                                          headers)
