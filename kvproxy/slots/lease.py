"""A request's hold on one slot, and what its swap did (sent back in X-KVProxy-* headers)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from kvproxy.sessions.identity import Session
from kvproxy.slots.executor import PromptView


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
    _release: Any = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        return {"X-KVProxy-Session": header_safe(self.session.id), "X-KVProxy-Cache": self.cache}


def header_safe(text: str) -> str:
    """An id as an HTTP header value: printable ASCII as is, anything else percent-encoded,
    so a hostile id from a request body can neither break nor inject response headers."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text
    # backslashreplace: a lone surrogate cannot be UTF-8 encoded and must not raise here.
    return quote(text.encode("utf-8", "backslashreplace"), safe="")
