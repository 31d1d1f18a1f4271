"""A request's hold on one slot, and what its swap did (sent back in X-KVProxy-* headers)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from kvproxy.sessions.identity import Session
from kvproxy.slots.outcome import Prefill, PromptView
from kvproxy.slots.plan import BASE, MISS, RESTORED
from kvproxy.slots.restore_check import MIN_TOKENS_TO_VERIFY
from kvproxy.storage.store import now_iso


@dataclass
class Lease:
    """The slot, held for one request."""

    session: Session
    cache: str
    restored_tokens: int = 0
    swap_ms: float = 0.0
    restored_stem: str | None = None
    made_by: dict | None = None  # what llama-server runs, when the swap asked
    prompt: PromptView | None = field(default=None, repr=False)  # for the restore check
    slot: int = 0                      # the llama-server slot it runs in (pin with id_slot)
    leased_at: float = 0.0             # monotonic time the slot was taken
    prefill: Prefill | None = None     # a base snapshot's prefill, computed by this swap
    restore_ms: float | None = None    # llama-server's time for this swap's restore
    began: int = 0                     # the generation it began in (slots.deletions)
    restored_saved_at: str | None = None  # the save restored (notes about it go on it alone)
    fetched_ms: float | None = None    # the restored file came from the shared store, this fast
    _release: Any = field(default=None, repr=False)

    def figures(self, timings: dict) -> dict:
        """The answer's ``timings`` as this request's usage: the tokens a base prefill of its
        swap computed count as computed, with their time, not as reused."""
        return self.prefill.timings(timings) if self.prefill and timings else timings

    def restore_note(self) -> dict:
        """What the restored file's sidecar records of this swap's restore ({} when none);
        written with the request's own bookkeeping, after the answer."""
        if self.restore_ms is None or not self.restored_stem:
            return {}
        return {"restore_ms": round(self.restore_ms, 2), "last_used_at": now_iso(),
                "restored_into_slot": self.slot}

    def outcome(self, timings: dict | None = None) -> str:
        """What the request reused, once llama-server's ``timings`` tell: a restore of which it
        reused nothing (a sliding-window model without --swa-full) is a ``miss``, whatever
        the swap did (a restore of fewer than 64 tokens is too short to tell). A restore that reused a part (the system prompt of a new chat under an
        old id) stays ``restored``: the usage figures tell how much."""
        if self.cache in (RESTORED, BASE) and timings and "cache_n" in timings and \
                self.restored_tokens >= MIN_TOKENS_TO_VERIFY and not int(timings["cache_n"] or 0):
            return MISS
        return self.cache

    def headers(self, timings: dict | None = None) -> dict[str, str]:
        """X-KVProxy-* headers; with the answer's ``timings`` (a whole answer) the cache
        outcome is what llama-server reused, a stream's headers leave before it knows."""
        fetched = {"X-KVProxy-Fetched": f"store; ms={self.fetched_ms:.0f}"} \
            if self.fetched_ms is not None else {}
        return {"X-KVProxy-Session": header_safe(self.session.id),
                "X-KVProxy-Cache": self.outcome(timings), **fetched}


def header_safe(text: str) -> str:
    """An id as an HTTP header value: printable ASCII as is, anything else percent-encoded,
    so a hostile id from a request body can neither break nor inject response headers."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text
    # backslashreplace: a lone surrogate cannot be UTF-8 encoded and must not raise here.
    return quote(text.encode("utf-8", "backslashreplace"), safe="")
