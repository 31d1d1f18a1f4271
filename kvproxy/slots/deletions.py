"""Deleted sessions, so that no request that began before a deletion brings the session back.

A request for a session may restore its file while an admin deletes it: the
restore read the old conversation, and the lease would record it in its slot,
where a hit would serve it again and a save (behind, at a swap, at shutdown)
would write it back. So each lease notes the generation it began in, and a
deletion is marked from its start (``deleting``) and, once its files are gone,
with the generation it ended in: a lease that began before that end records
nothing of the session (``undone``). One ``Deletions`` serves every model's
switch behind a router, as a session's deletion spans its files on every model.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Iterator


class Deletions:
    """When each session was last deleted, counted in lease generations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._running: Counter[str] = Counter()
        self._ended: dict[str, int] = {}

    def now(self) -> int:
        """The generation a lease beginning now belongs to."""
        with self._lock:
            return self._generation

    @contextlib.contextmanager
    def deleting(self, session_id: str) -> Iterator[None]:
        """While the body deletes ``session_id`` (empties its slots, removes its files), no
        lease records it; once it has, no lease that began before records it either. A
        deletion that fails (a slot stayed busy: 503) leaves no mark behind."""
        with self._lock:
            self._running[session_id] += 1
        done = False
        try:
            yield
            done = True
        finally:
            with self._lock:
                self._running[session_id] -= 1
                if not self._running[session_id]:
                    del self._running[session_id]
                if done:
                    self._generation += 1
                    self._ended[session_id] = self._generation

    def undone(self, session_id: str | None, began: int) -> bool:
        """Whether ``session_id`` is being deleted, or was deleted after a lease that began
        in generation ``began``: what that lease put in its slot must not be kept."""
        with self._lock:
            return bool(self._running.get(session_id)) or \
                self._ended.get(session_id, -1) > began
