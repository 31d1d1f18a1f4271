"""What answers teach a sidecar, held in memory and written at most once a second per session.

After every answer the session's sidecar learns its use: hits, last use, cache figures,
its trail. Writing that each time (a lock, a read, a temporary file renamed over the old
one) was most of kvproxy's own cost on a request that needs no swap. So a session's first
note is written at once, and the notes that follow within ``WRITE_EVERY_S`` of a write are
held and written together: by the next note once the second is over, or by one thread a
second after the last write, or at shutdown. Readers in this process see them merged
(``SessionStore.read_sidecar``, ``sidecars``); a crash loses at most the last second of
counts and last uses (a save writes its own fields at once, never through here).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("kvproxy.storage")

WRITE_EVERY_S = 1.0   # a session's sidecar takes held notes at most this often


@dataclass
class Note:
    """Changes held for one sidecar: fields to set (the newest wins) and counters to add to."""
    defaults: dict = field(default_factory=dict)   # a sidecar created by the note starts so
    fields: dict = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, counts: tuple[str, ...], fields: dict) -> None:
        self.fields.update(fields)
        for name in counts:
            self.counts[name] = self.counts.get(name, 0) + 1

    def merge(self, newer: "Note") -> None:
        """``newer``'s changes on top of these (a note put back after a failed write)."""
        self.defaults = {**newer.defaults, **self.defaults}
        self.fields.update(newer.fields)
        for name, n in newer.counts.items():
            self.counts[name] = self.counts.get(name, 0) + n

    def applied(self, sidecar: dict) -> dict:
        """``sidecar`` (changed in place and returned) with these changes."""
        sidecar.update(self.fields)
        for name, n in self.counts.items():
            sidecar[name] = int(sidecar.get(name) or 0) + n
        return sidecar

    def copy(self) -> "Note":
        return Note(dict(self.defaults), dict(self.fields), dict(self.counts))


class HeldNotes:
    """The notes of one slot folder not yet in their sidecars (one per process and folder,
    shared by every model's store). ``write(stem)`` folds a stem's held note into its
    sidecar (``SessionStore.write_held``); the thread that writes late notes starts with
    the first one held."""

    def __init__(self, write: Callable[[str], None], every: float = WRITE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self._write = write
        self.every = every
        self._clock = clock
        self._changed = threading.Condition()
        self._held: dict[str, Note] = {}
        self._written: dict[str, float] = {}   # stem -> when its notes were last written
        self._thread: threading.Thread | None = None

    def hold(self, stem: str, defaults: dict, counts: tuple[str, ...], fields: dict) -> bool:
        """Hold a note for ``stem``; True when it is due, and the caller writes it now
        (``write_held``): the stem's notes were not written in the last ``every`` seconds."""
        with self._changed:
            note = self._held.get(stem)
            first = note is None
            if first:
                note = self._held[stem] = Note(dict(defaults))
            note.add(counts, fields)
            last = self._written.get(stem)
            if last is None or self._clock() - last >= self.every:
                return True
            if first:   # the writer's next wake-up may be later (or never): tell it; waking
                self._start_writer()    # it costs this request a thread switch, so only then
                self._changed.notify()
            return False

    def take(self, stem: str) -> Note | None:
        """The stem's held note, for the caller to write; it counts as written now."""
        with self._changed:
            self._written[stem] = self._clock()
            return self._held.pop(stem, None)

    def put_back(self, stem: str, note: Note) -> None:
        """A note ``take`` handed out whose write failed: held again, under newer ones."""
        with self._changed:
            newer = self._held.get(stem)
            if newer is not None:
                note.merge(newer)
            self._held[stem] = note

    def peek(self, stem: str) -> Note | None:
        """A copy of the stem's held note (readers merge it into what they read)."""
        with self._changed:
            note = self._held.get(stem)
            return note.copy() if note is not None else None

    def drop(self, stem: str) -> None:
        """Forget the stem's held note (its session is deleted)."""
        with self._changed:
            self._held.pop(stem, None)
            self._written.pop(stem, None)

    def flush(self) -> None:
        """Write every held note now (at shutdown)."""
        with self._changed:
            stems = list(self._held)
        for stem in stems:
            self._write_logged(stem)

    def _start_writer(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvproxy-sidecar-notes",
                                            daemon=True)
            self._thread.start()

    def _due(self) -> tuple[list[str], float | None]:
        """Stems due for writing now, and the seconds until the next one is (None: none
        held). Forgets write times older than ``every``: they no longer hold anything back."""
        now = self._clock()
        due, wait = [], None
        for stem in self._held:
            left = self._written.get(stem, now - self.every) + self.every - now
            if left <= 0:
                due.append(stem)
            else:
                wait = left if wait is None else min(wait, left)
        for stem in [s for s, at in self._written.items()
                     if now - at >= self.every and s not in self._held]:
            del self._written[stem]
        return due, wait

    def _run(self) -> None:
        while True:
            with self._changed:
                due, wait = self._due()
                if not due:
                    self._changed.wait(wait)
                    continue
            for stem in due:
                self._write_logged(stem)

    def _write_logged(self, stem: str) -> None:
        try:
            self._write(stem)
        except Exception as exc:  # held again by the write; one bad sidecar stops no other
            log.warning("could not write the held notes of %s: %s", stem, exc)
            with self._changed:   # tried again a second later, not at once in a loop
                self._written[stem] = self._clock()
