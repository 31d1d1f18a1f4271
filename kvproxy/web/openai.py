"""OpenAI API: /v1/chat/completions, /v1/completions and /v1/models.

llama-server already speaks this dialect, so requests pass through with the
slot switch in front and streams are relayed event by event, unchanged.
"""
from __future__ import annotations

import json
import time
from typing import Iterable, Iterator

from flask import Blueprint, Response, jsonify, request

from kvproxy.errors import ClientError
from kvproxy.relay.context import ChatCall
from kvproxy import routes
from kvproxy.web.common import json_body, relay, serve_chat

blueprint = Blueprint("openai", __name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 502: "upstream_error", 503: "server_busy"}


def error_object(status: int, message: str) -> dict:
    default = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, default),
                      "param": None, "code": status}}


def render_error(status: int, message: str, headers: dict | None = None) -> Response:
    response = jsonify(error_object(status, message))
    response.status_code = status
    response.headers.update(headers or {})
    return response


def render_stream_error(status: int, message: str) -> bytes:
    return b"data: " + json.dumps(error_object(status, message)).encode() + b"\n\n"


def relay_stream(events: Iterable[tuple[bytes, dict | None]]) -> Iterator[bytes]:
    """Pass llama-server's SSE events through as they arrive."""
    for raw, _event in events:
        yield raw


def _serve(path: str, required: str, kinds: tuple[type, ...]) -> Response:
    body = json_body()
    if required not in body:
        raise ClientError(f"'{required}' is required")
    # Empty is llama-server's to judge: it answers an empty 'messages' list.
    if not isinstance(body[required], kinds):
        raise ClientError(f"'{required}' must be "
                          + " or ".join("an array" if k is list else "a string" for k in kinds))
    call = ChatCall(body=body, headers=request.headers, raw=body, path=path)
    return serve_chat(call, stream=bool(body.get("stream")), render_full=lambda result: result,
                      render_stream=relay_stream, render_stream_error=render_stream_error,
                      mimetype="text/event-stream")


def chat_completions() -> Response:
    """OpenAI chat completions, streamed or whole."""
    return _serve("/v1/chat/completions", "messages", (list,))


def completions() -> Response:
    """OpenAI legacy text completions (llama-server's /completions is its native route)."""
    return _serve("/v1/completions", "prompt", (str, list))


def models() -> Response:
    """The served model (behind a router: every model), with the fields both OpenAI and
    Anthropic clients read."""
    if relay().models.is_router():
        entries = [_entry(facts) for facts in relay().all_model_facts()]
        return jsonify({"object": "list", "data": entries, "has_more": False,
                        "first_id": entries[0]["id"] if entries else None,
                        "last_id": entries[-1]["id"] if entries else None})
    facts = relay().model_facts()
    entry = _entry(facts)
    listing = facts.get("listing") if isinstance(facts.get("listing"), dict) else {}
    named = [{**item, "name": facts["name"], "model": facts["name"]}
             for item in listing.get("models") or [] if isinstance(item, dict)]
    return jsonify({**({"models": named} if named else {}), "object": "list", "data": [entry],
                    "has_more": False, "first_id": entry["id"], "last_id": entry["id"]})


def _entry(facts: dict) -> dict:
    created = int(facts["model"].get("created") or time.time())
    # llama-server's own fields first (Maki reads meta), then the served name
    entry = {**facts["model"], "id": facts["name"], "object": "model", "created": created,
             "owned_by": facts["model"].get("owned_by") or "llamacpp", "type": "model",
             "display_name": facts["name"],
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))}
    return entry


routes.add_rules(blueprint, globals())
