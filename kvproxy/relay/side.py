"""Side requests: tasks that use a slot but belong to no conversation (embeddings, rerank).

One path for all of them, whether kvproxy builds the request (Ollama's embeddings) or
relays a llama-server route as it came (passthrough): the model the request names picks
the switch and the client (behind a router, that model's), and the task runs while every
slot of that switch is held (``slots.unpinned``), its body pinned to the slot it leased.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, TypeVar

import requests

from kvproxy.relay.context import RawCall, pinned
from kvproxy.slots.lease import Lease
from kvproxy.slots.models import ModelSwitches
from kvproxy.slots.unpinned import side_task
from kvproxy.upstream.llama import LlamaClient

T = TypeVar("T")


@dataclass(frozen=True)
class SideReply:
    """llama-server's whole answer to a relayed side request, read before the slot was freed."""

    upstream: requests.Response   # its status and headers (the body is read: ``content``)
    content: bytes
    headers: dict[str, str]       # the lease's X-KVProxy-* headers


def run_side(models: ModelSwitches, requested: object,
             send: Callable[[LlamaClient, Lease], T]) -> T:
    """``send`` a side task with the client of the model ``requested`` names, while every
    slot of its switch is held; the slot is freed once ``send`` returns."""
    switch, client = models.route(requested)
    with side_task(switch) as lease:
        return send(client, lease)


def side_json(models: ModelSwitches, path: str, body: dict) -> dict:
    """A side request kvproxy builds (embeddings): its JSON answer. Behind a router the body
    names the model by the router's id."""
    return run_side(models, body.get("model"), lambda client, lease: client.post_json(
        path, pinned(client._named(body), lease.slot)))


def side_relayed(models: ModelSwitches, call: RawCall) -> SideReply:
    """A side route relayed as it came: llama-server's answer whatever its status, read
    whole before the slot is freed (llama-server may go away mid-answer)."""
    def send(client: LlamaClient, lease: Lease) -> SideReply:
        upstream = client.forward(call.method, call.path, query=call.query,
                                  data=pinned_data(call.data, lease.slot),
                                  content_type=call.content_type, read_timeout=None,
                                  slot_call=True)
        return SideReply(upstream, client.content(upstream), lease.headers())
    return run_side(models, call.model, send)


def pinned_data(data: bytes, slot: int | None) -> bytes:
    """A side request's JSON object body pinned to its leased slot (``id_slot``), so
    llama-server does not pick an idle slot that holds a conversation; else as sent."""
    if slot is None or not data:
        return data
    try:
        body = json.loads(data)
    except ValueError:
        return data
    return json.dumps(pinned(body, slot)).encode() if isinstance(body, dict) else data
