"""An answer that holds its slot until the server has sent it: whole, or as a stream.

The server closes either once the reply is out, and only then is what the answer
showed (its timings) told to the switch, which records it and frees the slot; so the
bookkeeping never delays the client. Streams end early once the shutdown grace is over.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

from kvproxy.errors import ShuttingDown
from kvproxy.slots.lease import Lease
from kvproxy.slots.switch import SlotSwitch
from kvproxy.translate import usage
from kvproxy.upstream.llama import sse_events

_stop_at: list[float] = []  # monotonic deadline for running streams, set once at shutdown


def begin_shutdown(grace: float) -> None:
    """Called on SIGTERM (gunicorn.conf.py): streams may run ``grace`` seconds more."""
    if not _stop_at:
        _stop_at.append(time.monotonic() + grace)


def past_shutdown_grace() -> bool:
    return bool(_stop_at) and time.monotonic() >= _stop_at[0]


def timings_from_usage(result: Any) -> dict:
    """``cache_n``/``prompt_n``/``predicted_n`` from a usage object, for answers that carry
    no ``timings`` (llama-server's whole Responses API answer)."""
    usage = result.get("usage") if isinstance(result, dict) else None
    if not isinstance(usage, dict) or "input_tokens" not in usage:
        return {}
    details = usage.get("input_tokens_details")
    cached = int((details or {}).get("cached_tokens") or 0) if isinstance(details, dict) else 0
    return {"cache_n": cached, "prompt_n": max(int(usage.get("input_tokens") or 0) - cached, 0),
            "predicted_n": int(usage.get("output_tokens") or 0)}


class Answer:
    """A whole answer that holds the slot until it is closed.

    The server closes it once the reply is sent, so recording what the answer
    showed (sidecar, state file) does not delay the client.
    """

    def __init__(self, switch: SlotSwitch, lease: Lease, result: Any, translated: bool = False):
        self._switch = switch
        self.lease = lease
        timings = result.get("timings") if isinstance(result, dict) else None
        # llama-server's own figures, for the switch (it counts a base prefill itself)
        self.timings: dict = timings if isinstance(timings, dict) else timings_from_usage(result)
        self.result = usage.honest(result, lease.prefill, translated)
        self.headers = lease.headers(self.timings)

    def close(self) -> None:
        """Record the answer's timings and free the slot; idempotent."""
        self._switch.release(self.lease, self.timings)


class Exchange:
    """A streaming answer that holds the slot until it is closed."""

    def __init__(self, switch: SlotSwitch, lease: Lease, response, translated: bool = False):
        self._switch = switch
        self.lease = lease
        self._response = response
        self._translated = translated
        self.timings: dict = {}
        self.headers = lease.headers()

    def events(self) -> Iterator[tuple[bytes, dict | None]]:
        """Upstream SSE events as ``(raw bytes, parsed)``, as they arrive; their usage
        counts a base prefill of this request as computed (``usage.honest``)."""
        for raw, event in sse_events(self._response):
            if past_shutdown_grace():
                raise ShuttingDown("kvproxy is shutting down: the answer was cut short; "
                                   "send the request again")
            if isinstance(event, dict) and isinstance(event.get("timings"), dict):
                self.timings = event["timings"]
            told = usage.honest(event, self.lease.prefill, self._translated)
            if told is not event:
                raw, event = usage.reencoded(raw, told), told
            yield raw, event

    def close(self) -> None:
        """Close the upstream request (llama-server stops generating) and free the slot."""
        try:
            self._response.close()
        finally:
            self._switch.release(self.lease, self.timings)
