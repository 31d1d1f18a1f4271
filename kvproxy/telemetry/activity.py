"""What the slot did lately, kept in memory for the status page and the command line.

The switch feeds it one call per request, when the request ends: its cache
outcome, the swap it needed (if any) and llama-server's timings. Recent events
sit in bounded ring buffers (``collections.deque``), totals are counters since
the process started; nothing here touches the disk, so a restart starts afresh.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from datetime import datetime, timezone

OUTCOMES = ("hit", "restored", "base", "miss")


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds")


class RecentActivity:
    """Ring buffers of recent swaps and request outcomes, plus totals since start."""

    def __init__(self, max_swaps: int = 50, max_requests: int = 2000,
                 clock=time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self.started_at = clock()
        self.swaps: deque[dict] = deque(maxlen=max_swaps)
        self.requests: deque[tuple[float, str, int, int]] = deque(maxlen=max_requests)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.tokens = {"reused": 0, "computed": 0}

    def record(self, lease, timings: dict) -> None:
        """One request at its end (a switch ``Lease``): a swap unless the slot already held
        its session (hit), and its outcome and tokens when llama-server answered."""
        if lease.cache != "hit":
            self.record_swap(lease.session.id, lease.cache, lease.swap_ms, lease.restored_tokens,
                             lease.slot)
        if timings:  # a restore llama-server recomputed counts as the miss it was
            self.record_request(lease.outcome(timings), int(timings.get("cache_n") or 0),
                                int(timings.get("prompt_n") or 0))

    def record_swap(self, session_id: str, cache: str, swap_ms: float,
                    restored_tokens: int, slot: int = 0) -> None:
        """One swap of ``slot`` to ``session_id`` (save, then restore, base or erase)."""
        entry = {"at": _iso(self._clock()), "slot": slot, "session_id": session_id,
                 "cache": cache, "ms": round(swap_ms, 1), "restored_tokens": restored_tokens}
        with self._lock:
            self.swaps.append(entry)

    def record_request(self, cache: str, cache_n: int, prompt_n: int) -> None:
        """One finished request: its cache outcome and the prompt tokens reused and computed."""
        with self._lock:
            self.requests.append((self._clock(), cache, cache_n, prompt_n))
            if cache in self.outcomes:
                self.outcomes[cache] += 1
            self.tokens["reused"] += cache_n
            self.tokens["computed"] += prompt_n

    def totals(self) -> dict:
        """Counts since start; ``hit_ratio``: share of requests that did not start empty."""
        with self._lock:
            outcomes, tokens = dict(self.outcomes), dict(self.tokens)
        requests = sum(outcomes.values())
        prompt = tokens["reused"] + tokens["computed"]
        return {"since": _iso(self.started_at), "requests": requests, "outcomes": outcomes,
                "hit_ratio": round((requests - outcomes["miss"]) / requests, 4) if requests else None,
                "tokens": tokens,
                "reuse_ratio": round(tokens["reused"] / prompt, 4) if prompt else None}

    def recent_swaps(self, limit: int = 20) -> list[dict]:
        """The last swaps, newest first."""
        with self._lock:
            return list(self.swaps)[-limit:][::-1]

    def timeline(self, minutes: int = 30, bucket_s: int = 60) -> list[dict]:
        """Outcomes and tokens per minute over the last ``minutes``, oldest first, gaps as zeros."""
        now = self._clock()
        last = int(now // bucket_s)
        first = last - minutes + 1
        buckets = [{"t": _iso(b * bucket_s), **dict.fromkeys(OUTCOMES, 0), "reused": 0,
                    "computed": 0} for b in range(first, last + 1)]
        with self._lock:
            events = list(self.requests)
        for at, cache, cache_n, prompt_n in events:
            index = int(at // bucket_s) - first
            if 0 <= index < len(buckets):
                bucket = buckets[index]
                if cache in OUTCOMES:
                    bucket[cache] += 1
                bucket["reused"] += cache_n
                bucket["computed"] += prompt_n
        return buckets
