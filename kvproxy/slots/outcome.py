"""What a swap's filling did (``Filled``, a base snapshot's ``Prefill``), and the prompt it reads.

Shared by the executor that produces them, the lease that carries them to the answer, and the
usage figures that count a base prefill as computed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class PromptView(Protocol):
    """The request's prompt as llama-server tokenizes it (the relay provides it; asked lazily)."""

    def tokens(self) -> list[int]: ...

    def system_tokens(self, min_tokens: int = 0) -> list[int] | None: ...


class HeldElsewhere(Exception):
    """Another process put the session in another slot since the placement looked."""


@dataclass(frozen=True)
class Prefill:
    """A base snapshot's system prompt, computed into the slot by the swap of the request that
    needed it (llama-server's figures for that prefill). The request then finds those tokens
    in the slot, but they were computed for it: its usage reports them as computed."""

    computed: int      # tokens the prefill computed (its prompt_n)
    reused: int = 0    # tokens it found cached already (its cache_n)
    ms: float = 0.0    # its prompt_ms

    def moved(self, cache_n: int) -> int:
        """Of the ``cache_n`` tokens a request reused, those this prefill computed."""
        return max(0, min(cache_n, self.computed + self.reused) - self.reused)

    def timings(self, timings: dict) -> dict:
        """llama-server's ``timings`` of the request, with the tokens this prefill computed
        counted as computed (not reused) and its time added to the prompt's."""
        cache_n = int(timings.get("cache_n") or 0)
        moved = self.moved(cache_n)
        if not moved:
            return timings
        prompt_n = int(timings.get("prompt_n") or 0) + moved
        out = {**timings, "cache_n": cache_n - moved, "prompt_n": prompt_n}
        if "prompt_ms" in timings:
            ms = float(timings.get("prompt_ms") or 0) + self.ms
            out["prompt_ms"] = ms
            if "prompt_per_token_ms" in timings:
                out["prompt_per_token_ms"] = ms / prompt_n
            if "prompt_per_second" in timings:
                out["prompt_per_second"] = 1000.0 * prompt_n / ms if ms > 0 else 0.0
        return out


@dataclass(frozen=True)
class Filled:
    """What a swap's filling did: the cache state, the tokens the slot holds, the file used,
    the base prefill it computed."""

    cache: str
    tokens: int
    stem: str | None = None
    prefill: Prefill | None = None
    restore_ms: float | None = None   # llama-server's time for the restore, when one was made
    saved_at: str | None = None       # the save restored, as its sidecar said
