"""llama-server's own generation routes that are not chat completions.

``/v1/responses`` (OpenAI Responses API: Codex CLI, the Agents SDK), ``/infill``
(fill-in-the-middle: llama.vscode, llama.vim) and the native ``/completion``.
llama-server answers them itself, so the body goes to the same route with the
slot pinned, the answer comes back unchanged (streams event by event, named
events included), and kvproxy only adds its session handling. kvproxy checks
nothing llama-server checks: what it refuses, the client sees as llama-server
said it (status and message).
"""
from __future__ import annotations

from flask import Blueprint, Response, request

from kvproxy.relay.context import INFILL, RESPONSES, ChatCall
from kvproxy import routes
from kvproxy.web.common import json_body, serve_chat
from kvproxy.web.openai import relay_stream, render_stream_error

blueprint = Blueprint("llamacpp", __name__)


def _serve(call: ChatCall) -> Response:
    return serve_chat(call, stream=bool(call.body.get("stream")),
                      render_full=lambda result: result, render_stream=relay_stream,
                      render_stream_error=render_stream_error, mimetype="text/event-stream")


def responses() -> Response:
    """OpenAI Responses API, streamed or whole; session from prompt_cache_key, conversation,
    the session headers, or instructions plus the first user input."""
    body = json_body()
    return _serve(ChatCall(body=body, headers=request.headers, raw=body, path="/v1/responses",
                          kind=RESPONSES))


def infill() -> Response:
    """Fill-in-the-middle; one session per editor (and file, when named)."""
    body = json_body()
    return _serve(ChatCall(body=body, headers=request.headers, raw=body, path="/infill", kind=INFILL))


def completion() -> Response:
    """llama-server's native completion (not the OpenAI one at /v1/completions)."""
    body = json_body()
    return _serve(ChatCall(body=body, headers=request.headers, raw=body, path="/completion"))


routes.add_rules(blueprint, globals())
