"""Anthropic Messages API: /v1/messages and /v1/messages/count_tokens.

Claude Code and the ``anthropic`` SDK talk to this unchanged. Requests are
translated to llama-server's OpenAI chat format (``anthropic_translate``)
and answers back; no API key is checked, ``anthropic-version`` and
``anthropic-beta`` headers and the query string (``?beta=true``) are ignored.
"""
from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from kvproxy.relay.context import ChatCall
from kvproxy.translate import anthropic as translate
from kvproxy import routes
from kvproxy.web.common import json_body, relay, serve_chat

blueprint = Blueprint("anthropic", __name__)


def render_error(status: int, message: str, headers: dict | None = None) -> Response:
    """An error in Anthropic's shape; the SDKs choose their exception by status and type."""
    response = jsonify(translate.error_body(status, message))
    response.status_code = status
    response.headers.update(headers or {})
    return response


def _read(count_only: bool) -> tuple[dict, dict]:
    """The client's body and its llama-server translation, or ClientError."""
    body = json_body()
    return body, translate.to_llama(body, count_only=count_only)


def messages() -> Response:
    """A Message, whole or as Anthropic's server-sent events."""
    body, llama_body = _read(count_only=False)
    stream = body.get("stream") is True
    model = body["model"] if isinstance(body.get("model"), str) else relay().model_facts()["name"]
    stops = translate.stop_sequences(body)
    if stream:
        # Every chunk then carries llama-server's timings, so message_start (sent with the
        # first chunk) reports the real prompt and cache figures instead of zeros.
        llama_body["timings_per_token"] = True
    call = ChatCall(body=llama_body, headers=request.headers, raw=body,
                    path="/v1/chat/completions", translated=True)
    return serve_chat(
        call, stream=stream,
        render_full=lambda result: translate.to_message(result, model, stops),
        render_stream=lambda events: translate.stream_events(events, model, stops),
        render_stream_error=translate.stream_error, mimetype="text/event-stream")


def count_tokens() -> Response:
    """Prompt tokens as llama-server's template and tokenizer count them."""
    _body, llama_body = _read(count_only=True)
    return jsonify({"input_tokens": relay().count_tokens(llama_body)})


routes.add_rules(blueprint, globals())
