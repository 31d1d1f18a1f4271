"""The one error path: whatever a request ends with answers in the shape of its API family.

Views raise (``KvproxyError``, werkzeug's ``HTTPException``, or a bug); one
handler turns the error into status, message and headers and hands them to
the family's renderer. flask-smorest installs an app-wide handler with its own
shape: the admin API keeps it, every client API gets its own.
"""
from __future__ import annotations

from flask import Flask, current_app, request
from flask_smorest import abort
from werkzeug.exceptions import HTTPException

from kvproxy import routes
from kvproxy.errors import InternalError, KvproxyError, ReceiveTimeout, RequestTimedOut
from kvproxy.web import anthropic, ollama, openai
from kvproxy.web.common import free_held_slot

RENDERERS = {routes.OPENAI: openai.render_error, routes.ANTHROPIC: anthropic.render_error,
             routes.OLLAMA: ollama.render_error}


def answer(exc: Exception, api):
    """The error page for ``exc``; a page replaces the reply that would have freed the slot."""
    free_held_slot()
    # werkzeug reports a failed body read as ClientDisconnected, raised while handling it
    if isinstance(exc, ReceiveTimeout) or isinstance(exc.__context__, ReceiveTimeout):
        exc = RequestTimedOut()
    if not isinstance(exc, (HTTPException, KvproxyError)):
        current_app.log_exception((type(exc), exc, exc.__traceback__))
    if not isinstance(exc, KvproxyError) and getattr(exc, "code", 500) in (500, None):
        exc = InternalError(request.method, request.path)  # the same words for every bug
    shape = routes.error_shape(current_app.url_map, request)
    if shape == routes.ADMIN:
        return _admin_answer(exc, api)
    if isinstance(exc, KvproxyError):
        return RENDERERS[shape](exc.status, exc.client_message, exc.headers)
    headers = {}
    if exc.code == 405:
        headers["Allow"] = ", ".join(exc.valid_methods or ())
    if exc.code == 413:  # the unread rest of the body must not be taken for a next request
        headers["Connection"] = "close"
    return RENDERERS[shape](exc.code, f"{request.method} {request.path}: {exc.description}",
                            headers)


def _admin_answer(exc: HTTPException | KvproxyError, api):
    """flask-smorest's shape. A kvproxy failure (slot busy, llama-server down, slot folder)
    is a 503 the operator can retry; a bug stays a 500."""
    if isinstance(exc, KvproxyError):
        status = exc.status if exc.status < 499 or isinstance(exc, InternalError) else 503
        headers = {"Retry-After": "5", **exc.headers} if status == 503 else exc.headers
        try:
            abort(status, message=exc.client_message, headers=headers)
        except HTTPException as http:
            exc = http
    return api.handle_http_exception(exc)


def init_app(app: Flask, api) -> None:
    """Replace flask-smorest's handler (registered for ``HTTPException``) with the one path."""
    for kind in (HTTPException, Exception):
        app.register_error_handler(kind, lambda exc: answer(exc, api))
