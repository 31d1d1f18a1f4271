"""The trails of a slot folder's conversations, read through the store, for ``matching``.

An anonymous conversation is followed by what it shares with this scope's saved ones
(``sessions.matching``); their trails are in the sidecars. The index lists the folder at
most once every ``RESCAN_S`` (listing it means a stat per sidecar: with a thousand saved
conversations that was 3 ms of every anonymous request), takes what this process writes
or deletes as it happens without reading it back, rereads a sidecar only when its file
changed (modification time and size), and remembers the trails of requests matched whose
sidecar is not written yet. Another process's writes show at most ``RESCAN_S`` late, as
its held notes (``storage.notes``) do anyway.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from kvproxy.sessions.matching import trail_record
from kvproxy.storage.store import SessionStore

MAX_RECORDS = 1024         # the newest sidecars a request is compared with
MAX_NOTES = 256            # trails of requests whose sidecar is not written yet
NOTE_TTL_S = 3600.0        # a note whose sidecar never came (the request failed) is dropped
RESCAN_S = 1.0             # the folder is listed again at most this often
BASE_PREFIX = "base."      # base snapshots record no trail: never read
SIDECAR_SUFFIX = ".json"


class TrailIndex:
    """The trails recorded in a store's sidecars, the newest ``MAX_RECORDS`` of them, and the
    trails of requests this process matched whose sidecar does not show them yet.

    Those notes matter because a sidecar is written once the reply has been sent: a client
    that sends its next request at once (a second chat behind the same opening) must find
    the first one, or it would be merged into it."""

    def __init__(self, store: SessionStore, rescan_s: float = RESCAN_S,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.rescan_s = rescan_s
        self._clock = clock
        self._cache: dict[str, tuple[tuple[int, int], dict | None]] = {}
        self._notes: dict[str, tuple[float, dict]] = {}  # session id: (monotonic, record)
        self._listed: dict[str, tuple[int, int]] = {}    # sidecar name: (mtime ns, size)
        self._listed_at: float | None = None
        self._by_scope: dict[str, list[dict]] | None = None  # None: the listing changed
        self._lock = threading.Lock()

    def note(self, record: dict | None) -> None:
        """Remember the trail a request was matched to until its sidecar shows it."""
        if not record or not record.get("id"):
            return
        with self._lock:
            self._notes.pop(record["id"], None)
            self._notes[record["id"]] = (time.monotonic(), record)
            while len(self._notes) > MAX_NOTES:
                del self._notes[next(iter(self._notes))]

    def learn(self, name: str, written: tuple[int, int], sidecar: dict) -> None:
        """A sidecar this process has just written (``SessionStore.tell_sidecar_writes``):
        listed and cached as the folder's listing will show it, so the next request does not
        read it back. A file another process writes later differs in time or size and is read."""
        record = trail_record(sidecar)
        with self._lock:
            self._cache[name] = (written, dict(record) if record is not None else None)
            if not name.startswith(BASE_PREFIX):
                self._listed[name] = written
                self._by_scope = None

    def forget(self, name: str) -> None:
        """A sidecar this process has just deleted: no longer listed."""
        with self._lock:
            self._cache.pop(name, None)
            if self._listed.pop(name, None) is not None:
                self._by_scope = None

    def records(self, scope: str) -> list[dict]:
        """This scope's records: the sidecars', each replaced by a newer note of its session."""
        on_disk = self._on_disk(scope)
        with self._lock:
            now = time.monotonic()
            ids = {record.get("id"): record for record in on_disk}
            for session_id, (noted_at, record) in list(self._notes.items()):
                saved = ids.get(session_id)
                if now - noted_at > NOTE_TTL_S or \
                        (saved is not None and saved.get("whole") == record.get("whole")):
                    del self._notes[session_id]  # the sidecar caught up (or it never will)
                elif record.get("scope") == scope:
                    ids[session_id] = record
        return list(ids.values())

    def _on_disk(self, scope: str) -> list[dict]:
        self._list_if_due()
        with self._lock:
            if self._by_scope is None:
                self._by_scope = self._grouped()
            return list(self._by_scope.get(scope, ()))

    def _list_if_due(self) -> None:
        with self._lock:
            if self._listed_at is not None and \
                    self._clock() - self._listed_at < self.rescan_s:
                return
        started = self._clock()
        listed = {name: (mtime, size) for name, mtime, size in self.store.sidecar_files()
                  if not name.startswith(BASE_PREFIX)}
        with self._lock:
            self._listed, self._listed_at, self._by_scope = listed, started, None

    def _grouped(self) -> dict[str, list[dict]]:
        """The newest ``MAX_RECORDS`` listed sidecars' records by scope, reading those that
        changed (called under the lock, once per change of the listing)."""
        newest = sorted(((mtime, name, size) for name, (mtime, size) in self._listed.items()),
                        reverse=True)[:MAX_RECORDS]
        by_scope: dict[str, list[dict]] = {}
        for mtime, name, size in newest:
            cached = self._cache.get(name)
            if cached is None or cached[0] != (mtime, size):
                cached = ((mtime, size), self._read(name))
                self._cache[name] = cached
            record = cached[1]
            if record and isinstance(record.get("scope"), str):
                by_scope.setdefault(record["scope"], []).append(record)
        kept = {name for _mtime, name, _size in newest}
        for name in [n for n in self._cache if n not in kept]:
            del self._cache[name]
        return by_scope

    def _read(self, name: str) -> dict | None:
        """The trail of one sidecar, as the store reads it (older formats migrated)."""
        try:
            sidecar = self.store.read_sidecar(name.removesuffix(SIDECAR_SUFFIX))
        except OSError:
            return None
        return trail_record(sidecar)
