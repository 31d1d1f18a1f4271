"""llama-server routes kvproxy relays as they are: the passthrough rows of ``kvproxy.routes``.

``plain`` routes never touch the slot (tokenizer, template, token counts,
server properties): the request goes on unchanged, without waiting for the
slot, and llama-server's answer comes back unchanged, its errors included.
``side`` routes run a task on the slot (embeddings, rerank): they wait for the
slot like a side request, which saves the conversation it held first and is
never saved itself. llama-server ignores ``id_slot`` for all of them, so with
several slots they run while kvproxy holds every slot (``kvproxy.relay.side``).
Only kvproxy's own failures (llama-server unreachable, slot busy) answer in
OpenAI's error shape. Methods that change llama-server for
everyone (``POST /props``, ``POST /lora-adapters``) need the admin token when
one is set, like the session admin API (the table's ``token``).
"""
from __future__ import annotations

import json
from typing import Iterator

import requests
from flask import Blueprint, Response, request

from kvproxy import routes
from kvproxy.errors import ClientError, UpstreamUnavailable
from kvproxy.relay.context import RawCall
from kvproxy.upstream.llama import LlamaClient
from kvproxy.web.common import relay

blueprint = Blueprint("passthrough", __name__)

# llama-server answers these quickly; a stuck one must not hold a client for long.
PLAIN_READ_TIMEOUT = 60.0
# Headers of llama-server's answer that describe the body, and so go back with it.
KEPT_HEADERS = ("Content-Type", "Cache-Control")


def plain() -> Response:
    """Relayed as it is, without waiting for the slot; llama-server's answer as it comes."""
    upstream = relay().forward(_raw_call(), PLAIN_READ_TIMEOUT)
    response = Response(_chunks(relay().client, upstream), status=upstream.status_code,
                        headers=_kept_headers(upstream), direct_passthrough=True)
    response.call_on_close(upstream.close)
    return response


def side() -> Response:
    """A side task, for the model the request names (behind a router): the slot is freed
    before the answer goes out (it holds nothing after it). llama-server ignores
    ``id_slot`` for every side route, so the task runs while every slot is held
    (``kvproxy.relay.side``)."""
    reply = relay().side_relayed(_raw_call(model=_model_named()))
    return Response(reply.content, status=reply.upstream.status_code,
                    headers={**_kept_headers(reply.upstream), **reply.headers})


def _raw_call(model: object = None) -> RawCall:
    """The request as llama-server gets it: method, path, query and body unchanged."""
    route = routes.of_request(request)
    return RawCall(request.method, request.path, query=request.query_string,
                   data=request.get_data(), content_type=request.headers.get("Content-Type"),
                   model=model,
                   changes_fingerprint=bool(route) and request.method in route.changes_fingerprint)


def _model_named() -> object:
    """The model a side request names: in its JSON body, or a field of its form (a
    transcription's upload); None when it names none."""
    data = request.get_data()   # read first: the form is then parsed from it, and sent as is
    if request.mimetype != "application/json":
        return request.form.get("model")
    try:
        body = json.loads(data)
    except ValueError:
        return None
    return body.get("model") if isinstance(body, dict) else None


def refused(**_path_args: str) -> Response:
    """Routes kvproxy keeps to itself: the table's note says why."""
    why = routes.of_request(request).note
    raise ClientError(f"{request.method} {request.path}: {why}", 403)


def _kept_headers(upstream: requests.Response) -> dict:
    return {name: upstream.headers[name] for name in KEPT_HEADERS if name in upstream.headers}


def _chunks(client: LlamaClient, upstream: requests.Response) -> Iterator[bytes]:
    """llama-server's answer as it comes; a broken read ends it (the status is already sent)."""
    try:
        yield from client.chunks(upstream)
    except UpstreamUnavailable:
        return


routes.add_rules(blueprint, globals())
