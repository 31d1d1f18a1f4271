"""llama-server routes kvproxy relays as they are: every one in ``ROUTES``.

``PLAIN`` routes never touch the slot (tokenizer, template, token counts,
server properties): the request goes on unchanged, without waiting for the
slot, and llama-server's answer comes back unchanged, its errors included.
``SIDE`` routes run a task on the slot (embeddings, rerank): they wait for the
slot like a side request, which saves the conversation it held first and is
never saved itself. llama-server ignores ``id_slot`` for all of them, so with
several slots the other idle slots are protected too (``kvproxy.slots.unpinned``).
Only kvproxy's own failures (llama-server unreachable, slot busy) answer in
OpenAI's error shape. Methods that change llama-server for
everyone (``POST /props``, ``POST /lora-adapters``) need the admin token when
one is set, like the session admin API.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

import hmac

import requests
from flask import Blueprint, Response, current_app, request

from kvproxy.errors import UpstreamUnavailable
from kvproxy.sessions.identity import SIDE_SESSION, Session
from kvproxy.upstream.llama import LlamaClient
from kvproxy.web.relay import pinned
from kvproxy.slots.unpinned import protect_other_slots
from kvproxy.web.common import HANDLED, failure, relay
from kvproxy.web.openai import render_error

blueprint = Blueprint("passthrough", __name__)

PLAIN = "plain"
SIDE = "side"
REFUSED = "refused"
# llama-server answers these quickly; a stuck one must not hold a client for long.
PLAIN_READ_TIMEOUT = 60.0
# Headers of llama-server's answer that describe the body, and so go back with it.
KEPT_HEADERS = ("Content-Type", "Cache-Control")


@dataclass(frozen=True)
class Route:
    paths: tuple[str, ...]
    methods: tuple[str, ...]
    kind: str
    why: str
    admin_methods: tuple[str, ...] = ()  # change the server for everyone: admin token


ROUTES = (
    Route(("/props",), ("GET", "POST"), PLAIN,
          "model and server properties (Maki discovers the model here)", ("POST",)),
    Route(("/tokenize", "/detokenize"), ("POST",), PLAIN, "the model's tokenizer"),
    Route(("/apply-template",), ("POST",), PLAIN, "the chat template, without generating"),
    Route(("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
           "/responses/input_tokens", "/v1/responses/input_tokens"), ("POST",), PLAIN,
          "token counts of a chat or Responses request"),
    Route(("/v1/chat/completions/control",), ("POST",), PLAIN,
          "steers an answer that is running, so it must not wait for the slot"),
    Route(("/slots",), ("GET",), PLAIN, "slot state, read only (slot actions are kvproxy's)"),
    Route(("/lora-adapters",), ("GET", "POST"), PLAIN, "LoRA adapter scales", ("POST",)),
    Route(("/v1/health",), ("GET",), PLAIN, "llama-server's own health"),
    Route(("/v1/stream",), ("GET", "DELETE"), PLAIN, "resumable streams of the web UI"),
    Route(("/v1/streams/lookup",), ("POST",), PLAIN, "resumable streams of the web UI"),
    Route(("/embedding", "/embeddings", "/v1/embeddings"), ("POST",), SIDE,
          "embeddings (llama-server needs --embeddings)"),
    Route(("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"), ("POST",), SIDE,
          "reranking (llama-server needs --reranking and a reranker model)"),
    Route(("/audio/transcriptions", "/v1/audio/transcriptions"), ("POST",), SIDE,
          "speech to text (needs an audio model)"),
    Route(("/v1/systemone",), ("POST",), SIDE, "decision models"),
    Route(("/slots/<id_slot>",), ("POST",), REFUSED,
          "slot save, restore and erase belong to kvproxy: use /api/sessions"),
)


def _admin_token_missing(route: Route) -> bool:
    """A server-wide change without the admin token, when one is configured."""
    token = current_app.config["KVPROXY"].admin_token
    if not token or request.method not in route.admin_methods:
        return False
    sent = request.headers.get("Authorization", "")
    return not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode())


def _forward(route: Route) -> Response:
    if route.kind == REFUSED:
        return render_error(403, f"{request.method} {request.path}: {route.why}")
    if _admin_token_missing(route):
        return render_error(401, f"{request.method} {request.path} changes llama-server for "
                                 "every client: send 'Authorization: Bearer <admin token>'")
    if route.kind == SIDE:
        return _forward_side()
    try:
        upstream = _send(None)
    except HANDLED as exc:
        return render_error(*failure(exc))
    response = Response(_chunks(relay().client, upstream), status=upstream.status_code,
                        headers=_kept_headers(upstream), direct_passthrough=True)
    response.call_on_close(upstream.close)
    return response


def _forward_side() -> Response:
    """A side task: the slot is freed before the answer goes out (it holds nothing after it).
    llama-server ignores ``id_slot`` for every ``SIDE`` route, so the other slots are
    protected while it runs (``unpinned``)."""
    switch = relay().switch
    try:
        lease = switch.acquire(Session(SIDE_SESSION, "side-request", persistent=False))
    except HANDLED as exc:
        return render_error(*failure(exc))
    try:
        with protect_other_slots(switch, lease):
            upstream = _send(lease)
            content = relay().client.content(upstream)  # llama-server may go away mid-answer
    except HANDLED as exc:
        return render_error(*failure(exc))
    finally:
        switch.release(lease)
    return Response(content, status=upstream.status_code,
                    headers={**_kept_headers(upstream), **lease.headers()})


def _send(lease) -> requests.Response:
    """The request as sent, to llama-server (a side task's JSON body pinned to ``lease``)."""
    side = lease is not None
    return relay().client.forward(request.method, request.path, query=request.query_string,
                                  data=pinned_data(request.get_data(), lease),
                                  content_type=request.headers.get("Content-Type"),
                                  read_timeout=None if side else PLAIN_READ_TIMEOUT,
                                  slot_call=side)


def _kept_headers(upstream: requests.Response) -> dict:
    return {name: upstream.headers[name] for name in KEPT_HEADERS if name in upstream.headers}


def pinned_data(data: bytes, lease) -> bytes:
    """A side request's JSON object body pinned to its leased slot (``id_slot``), so
    llama-server does not pick an idle slot that holds a conversation; else as sent."""
    if lease is None or not data:
        return data
    try:
        body = json.loads(data)
    except ValueError:
        return data
    return json.dumps(pinned(body, lease.slot)).encode() if isinstance(body, dict) else data


def _chunks(client: LlamaClient, upstream: requests.Response) -> Iterator[bytes]:
    """llama-server's answer as it comes; a broken read ends it (the status is already sent)."""
    try:
        yield from client.chunks(upstream)
    except UpstreamUnavailable:
        return


def _register() -> None:
    for route in ROUTES:
        def view(route: Route = route, **_path_args: str) -> Response:
            return _forward(route)
        for path in route.paths:
            endpoint = path.strip("/").replace("/", "_").replace("<", "").replace(">", "")
            blueprint.add_url_rule(path, endpoint=endpoint,
                                   view_func=view, methods=list(route.methods))


_register()
