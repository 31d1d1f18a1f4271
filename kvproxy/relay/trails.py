"""The trails of a slot folder's conversations, read through the store, for ``matching``.

An anonymous conversation is followed by what it shares with this scope's saved ones
(``sessions.matching``); their trails are in the sidecars. The index lists the folder at
most once every ``RESCAN_S`` (listing it means a stat per sidecar: with a thousand saved
conversations that was 3 ms of every anonymous request), takes what this process writes
or deletes as it happens without reading it back, rereads a sidecar only when its file
changed (modification time and size), and remembers the trails of requests matched whose
sidecar is not written yet. Only the first listing runs on a request's path: later ones
run on a thread of their own while requests use the last one, so no request waits for a
stat per sidecar once a second. Another process's writes show at most ``RESCAN_S`` plus
one listing late, as its held notes (``storage.notes``) do anyway.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvproxy.sessions.matching import trail_record
from kvproxy.storage.store import SessionStore

log = logging.getLogger("kvproxy.relay")

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
                 clock: Callable[[], float] = time.monotonic,
                 in_background: Callable[[Callable[[], None]], None] | None = None):
        self.store = store
        self.rescan_s = rescan_s
        self._clock = clock
        self._in_background = in_background or on_a_thread
        self._cache: dict[str, tuple[tuple[int, int], dict | None]] = {}
        self._notes: dict[str, tuple[float, dict]] = {}  # session id: (monotonic, record)
        self._listed_at: float | None = None
        # The grouped records: scope -> sidecar name -> record, oldest first (a session's
        # newest sidecar speaks for it); None until the first listing.
        self._by_scope: dict[str, dict[str, dict]] | None = None
        # While a listing runs: the sidecars this process wrote or deleted meanwhile, taken
        # as the cache has them when the listing is taken (it may predate them).
        self._meanwhile: set[str] | None = None
        self._lock = threading.Lock()
        self._first_listing = threading.Lock()

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
        cached and grouped as the folder's next listing will find it, so no request reads it
        back or regroups the folder. A file another process writes later differs in time or
        size and is read."""
        record = trail_record(sidecar)
        record = dict(record) if record is not None else None
        with self._lock:
            _ungroup(self._by_scope, self._cache, name)
            self._cache[name] = (written, record)
            if not name.startswith(BASE_PREFIX):
                _group(self._by_scope, name, record)
                if self._meanwhile is not None:
                    self._meanwhile.add(name)

    def forget(self, name: str) -> None:
        """A sidecar this process has just deleted: out of the cache and the grouping."""
        with self._lock:
            _ungroup(self._by_scope, self._cache, name)
            self._cache.pop(name, None)
            if self._meanwhile is not None:
                self._meanwhile.add(name)

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
                return []  # the first listing failed: the next request tries again
            return list(self._by_scope.get(scope, {}).values())

    def _list_if_due(self) -> None:
        """List the folder on this request's path the first time (a request that comes
        meanwhile waits for that listing); later, when due, start a listing in the background
        (one at a time) and go on with the last one."""
        with self._lock:
            first = self._listed_at is None
            if not first:
                if self._meanwhile is not None or \
                        self._clock() - self._listed_at < self.rescan_s:
                    return
                self._meanwhile = set()
        if first:
            with self._first_listing:
                with self._lock:
                    if self._listed_at is not None:
                        return
                    self._meanwhile = set()
                self._list()
            return
        try:
            self._in_background(self._list)
        except Exception as exc:  # no thread to be had: the last listing serves meanwhile
            log.warning("the slot folder could not be listed in the background: %s", exc)
            with self._lock:
                self._meanwhile = None

    def _list(self) -> None:
        """List the folder and group its records, outside the lock (requests go on with the
        last grouping), then take both, with what this process wrote or deleted meanwhile
        laid over them (the listing may predate it)."""
        started = self._clock()
        try:
            listed = {name: (mtime, size) for name, mtime, size in self.store.sidecar_files()
                      if not name.startswith(BASE_PREFIX)}
            with self._lock:
                cache = dict(self._cache)
            by_scope, cache = self._grouped(listed, cache)
        except BaseException:
            with self._lock:
                self._meanwhile = None
            raise
        with self._lock:
            meanwhile, self._meanwhile = self._meanwhile or set(), None
            for name in meanwhile:
                _ungroup(by_scope, cache, name)
                current = self._cache.get(name)   # None: deleted
                if current is None:
                    cache.pop(name, None)
                else:
                    cache[name] = current
                    _group(by_scope, name, current[1])
            self._listed_at, self._cache, self._by_scope = started, cache, by_scope

    def _grouped(self, listed: dict[str, tuple[int, int]],
                 cache: dict[str, tuple[tuple[int, int], dict | None]]
                 ) -> tuple[dict[str, dict[str, dict]], dict]:
        """The newest ``MAX_RECORDS`` listed sidecars' records by scope, oldest first, and the
        cache of their trails, reading those that changed."""
        newest = sorted(((mtime, name, size) for name, (mtime, size) in listed.items()),
                        reverse=True)[:MAX_RECORDS]
        by_scope: dict[str, dict[str, dict]] = {}
        kept = {}
        for mtime, name, size in reversed(newest):
            cached = cache.get(name)
            if cached is None or cached[0] != (mtime, size):
                cached = ((mtime, size), self._read(name))
            kept[name] = cached
            _group(by_scope, name, cached[1])
        return by_scope, kept

    def _read(self, name: str) -> dict | None:
        """The trail of one sidecar, as the store reads it (older formats migrated)."""
        try:
            sidecar = self.store.read_sidecar(name.removesuffix(SIDECAR_SUFFIX))
        except OSError:
            return None
        return trail_record(sidecar)


def _group(by_scope: dict[str, dict[str, dict]] | None, name: str, record: dict | None) -> None:
    """Add a sidecar's record to a grouping, as its newest."""
    if by_scope is not None and record and isinstance(record.get("scope"), str):
        by_scope.setdefault(record["scope"], {})[name] = record


def _ungroup(by_scope: dict[str, dict[str, dict]] | None,
             cache: dict[str, tuple[tuple[int, int], dict | None]], name: str) -> None:
    """Take a sidecar's record (as ``cache`` has it) out of a grouping."""
    cached = cache.get(name)
    scope = cached[1].get("scope") if cached and cached[1] else None
    if by_scope is not None and isinstance(scope, str):
        by_scope.get(scope, {}).pop(name, None)


def on_a_thread(job: Callable[[], None]) -> None:
    """Run ``job`` on a daemon thread of its own (a listing: a stat per sidecar, and a read
    of each sidecar that changed)."""
    def run() -> None:
        try:
            job()
        except Exception:  # the next due request starts another
            log.exception("listing the slot folder failed")
    threading.Thread(target=run, name="kvproxy-trail-listing", daemon=True).start()
