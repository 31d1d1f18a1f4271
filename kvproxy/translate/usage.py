"""Usage figures of llama-server's answers as this request's own: exact, never estimated.

When a request's swap made a base snapshot, kvproxy computed the system prompt
into the slot as a step of its own (``SlotExecutor.make_base``), and llama-server
then reports those tokens as cached. They were computed for this request, so its
usage reports them as computed: OpenAI ``prompt_tokens_details.cached_tokens``
and the Responses API's ``input_tokens_details.cached_tokens`` lose them (the
prompt's total stays), and, for the APIs kvproxy renders itself (Anthropic,
Ollama), the ``timings`` they are rendered from count them in ``prompt_n`` with
the prefill's time in ``prompt_ms``. ``prefill`` is the lease's
(``slots.executor.Prefill``); None leaves everything as llama-server sent it.
"""
from __future__ import annotations

import json
from typing import Any

DETAILS = ("prompt_tokens_details", "input_tokens_details")


def honest(obj: Any, prefill: Any, timings: bool = False) -> Any:
    """``obj`` (a whole answer or one stream event) with its usage counting the tokens
    ``prefill`` computed as computed; with ``timings``, its ``timings`` too. The same
    object when nothing changes, else a changed copy (the original is left alone)."""
    if prefill is None or not isinstance(obj, dict):
        return obj
    out = dict(obj)
    usage = _usage(obj.get("usage"), prefill)
    if usage is not obj.get("usage"):
        out["usage"] = usage
    response = obj.get("response")  # the Responses API's response.completed event
    if isinstance(response, dict):
        inner = _usage(response.get("usage"), prefill)
        if inner is not response.get("usage"):
            out["response"] = {**response, "usage": inner}
    if timings and isinstance(obj.get("timings"), dict):
        out["timings"] = prefill.timings(obj["timings"])
    changed = any(out[key] is not obj.get(key) for key in out)
    return out if changed else obj


def _usage(usage: Any, prefill: Any) -> Any:
    if not isinstance(usage, dict):
        return usage
    for key in DETAILS:
        details = usage.get(key)
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not isinstance(cached, bool):
            moved = prefill.moved(cached)
            if moved:
                return {**usage, key: {**details, "cached_tokens": cached - moved}}
    return usage


def reencoded(raw: bytes, event: dict) -> bytes:
    """A stream event's bytes for a changed ``event``, its ``event:`` line kept."""
    head = raw[:raw.find(b"data:")] if b"data:" in raw else b""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()
    return head + b"data: " + data + b"\n\n"
