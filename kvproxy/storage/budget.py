"""The slot folder's disk budget: its bound, the free space kept, and what to evict.

Which files to evict is decided by a pure function, ``plan_eviction``; ``DiskBudget``
carries it out, one save at a time, never deleting a file a swap is about to restore.
A file's size on disk includes its companions, which go with it.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

import filelock

from kvproxy.telemetry import metrics
from kvproxy.storage.checked_save import SaveFailed
from kvproxy.storage.store import (CHUNKED_SUFFIX, QUARANTINE_DIR, SessionStore, bytes_with_companions,
                                   companion_index, now_iso,
                                   unlink_with_companions)
from kvproxy.storage.sweep import is_leftover, orphan_companions

log = logging.getLogger("kvproxy.disk")

GB = 1024**3
MB = 1024**2
# The free-space floor (KVPROXY_MIN_FREE_GB) never asks for more than this share of the
# filesystem's size: on a disk smaller than the floor, every save would be refused.
MAX_FREE_SHARE = 0.1
# How long /health and the status page report a dropped save.
TROUBLE_SECONDS = 600
# How long a save waits for the one before it in the same folder (llama-server writes one
# slot file at a time anyway, in its main loop).
SAVE_WAIT_SECONDS = 300


class SharedBytes(Protocol):
    """Bytes several sessions share (``chunks.files.ChunkedFiles``): counted once."""

    def usage(self) -> tuple[int, dict[str, int]]:
        """All shared bytes, and per stem what only it uses."""
        ...

    def free(self) -> int:
        """Delete what no session uses any more; the bytes freed."""
        ...


SAVED_SUFFIXES = (".bin", CHUNKED_SUFFIX)   # a session's own file: whole, or its manifest


def saved_stem(path: Path) -> str:
    return path.name[:-len(CHUNKED_SUFFIX)] if path.name.endswith(CHUNKED_SUFFIX) else path.stem


@dataclass(frozen=True)
class Entry:
    """A file that takes room in the slot folder and may be evicted."""

    path: Path
    size: int
    used: str          # last use (ISO time): oldest goes first
    stem: str | None   # a session or base snapshot (file and sidecar go together)
    loose: bool        # quarantined, orphaned or left over: goes before any session


def plan_eviction(entries: list[Entry], *, total: int, incoming: int, replacing: int,
                  free: int | None, max_bytes: int, min_free: int) -> tuple[list[Entry], bool]:
    """What to delete so a save of about ``incoming`` bytes fits; returns ``(victims, fits)``.

    ``total`` is what the folder holds now, ``replacing`` the size of the file
    the save will replace, ``free`` the free bytes of its filesystem (None:
    unknown). Loose files go first, then the least recently used sessions. The
    folder bound (``max_bytes``, 0: none) is kept as far as eviction can; the
    free-space reserve (``min_free``) is a hard limit: when even evicting
    everything allowed cannot keep it, nothing is deleted and ``fits`` is False.
    """
    order = sorted(entries, key=lambda e: (not e.loose, e.used))
    if free is not None and free + sum(e.size for e in order) - incoming < min_free:
        return [], False
    victims = []
    for entry in order:
        over_bound = bool(max_bytes) and total + incoming - replacing > max_bytes
        short = free is not None and free - incoming < min_free
        if not (over_bound or short):
            break
        victims.append(entry)
        total -= entry.size
        if free is not None:
            free += entry.size
    return victims, True


def shown(n_bytes: float) -> str:
    """Bytes for a log line: MB with a decimal below 10 MB, KB below 1 MB."""
    if n_bytes < MB:
        return f"{n_bytes / 1024:.0f} KB"
    return f"{n_bytes / MB:.1f} MB" if n_bytes < 10 * MB else f"{n_bytes / MB:.0f} MB"


class DroppedSaves:
    """Saves the slot folder could not take: how many, and the last one (for /health, the
    status page and the log). Thread-safe; in memory, per process."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.count = 0
        self.last: dict | None = None
        self._last_at: float | None = None
        self._lock = threading.Lock()

    def note(self, stem: str, session_id: str, reason: str) -> None:
        with self._lock:
            self.count += 1
            self.last = {"at": now_iso(), "session_id": session_id, "file": f"{stem}.bin",
                         "reason": reason}
            self._last_at = self.clock()

    def recent(self, seconds: float = TROUBLE_SECONDS) -> dict | None:
        """The last dropped save, when it was less than ``seconds`` ago."""
        with self._lock:
            if self._last_at is None or self.clock() - self._last_at > seconds:
                return None
            return dict(self.last or {})


class DiskBudget:
    """Keeps the slot folder within ``max_bytes`` and its filesystem ``min_free`` bytes free
    (at most ``MAX_FREE_SHARE`` of the filesystem's size), and counts the saves it could
    not take (``dropped``).

    Saves into the folder run one at a time (``saving``): two slots saving one file (two
    new conversations making one base snapshot) never share its temporary file, and
    eviction never meets another save's. Files a swap is about to restore are ``pinned``
    from before the swap reads them until it is done: eviction chooses and deletes under the
    same lock, so it never deletes a file between a swap's look and llama-server's read."""

    def __init__(self, store: SessionStore, max_bytes: int = 0, min_free: int = 0):
        self.store = store
        self.max_bytes = max_bytes
        self.min_free = min_free
        self.dropped = DroppedSaves()
        self._save_thread_lock = threading.Lock()
        self._save_file_lock = filelock.FileLock(str(store.save_lock_path), thread_local=False)
        self._pins: collections.Counter[str] = collections.Counter()
        self._pins_lock = threading.Lock()
        self.shared: SharedBytes | None = None   # chunks, when sessions are stored as chunks

    @contextlib.contextmanager
    def saving(self, timeout: float = SAVE_WAIT_SECONDS) -> Iterator[None]:
        """Hold the folder's save lock (threads and processes), waiting at most ``timeout``
        seconds; SaveFailed when another save holds it longer."""
        deadline = time.monotonic() + timeout
        if not self._save_thread_lock.acquire(timeout=timeout):
            raise SaveFailed(f"another save into the slot folder took more than {timeout:.0f} s")
        try:
            try:
                self._save_file_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            except filelock.Timeout:
                raise SaveFailed(f"another process's save into the slot folder took more than "
                                 f"{timeout:.0f} s") from None
            try:
                yield
            finally:
                self._save_file_lock.release()
        finally:
            self._save_thread_lock.release()

    @contextlib.contextmanager
    def pinned(self, stems: Iterable[str]) -> Iterator[None]:
        """Keep ``stems`` from eviction while the block runs (a swap that may restore them)."""
        stems = list(stems)
        with self._pins_lock:
            self._pins.update(stems)
        try:
            yield
        finally:
            with self._pins_lock:
                self._pins.subtract(stems)
                self._pins += collections.Counter()   # drops stems no swap pins any more

    def share_pins(self, other: "DiskBudget") -> None:
        """Pin and evict as one with ``other``, a budget of the same folder (another model's,
        behind a router): neither evicts a file a swap of the other pinned."""
        self._pins, self._pins_lock = other._pins, other._pins_lock

    def free_bytes(self) -> int | None:
        try:
            return shutil.disk_usage(self.store.root).free
        except OSError:
            return None

    def floor(self) -> int:
        """The free space kept: ``min_free``, but never more than ``MAX_FREE_SHARE`` of the
        filesystem's size, so a small disk still takes saves."""
        try:
            size = shutil.disk_usage(self.store.root).total
        except OSError:
            return self.min_free
        return min(self.min_free, int(size * MAX_FREE_SHARE))

    def problem(self) -> str | None:
        """What is wrong with the slot folder's disk now, for /health and the status page:
        a save dropped in the last ``TROUBLE_SECONDS``, or less free space than the floor
        (which eviction keeps when it can). None when nothing is."""
        last = self.dropped.recent()
        if last:
            return (f"the save of session {last['session_id']} was dropped at {last['at']} "
                    f"({self.dropped.count} dropped since start): {last['reason']}")
        free, floor = self.free_bytes(), self.floor()
        if free is not None and floor and free < floor:
            return (f"{shown(free)} free on the slot folder's filesystem, less than the "
                    f"{shown(floor)} kept free (KVPROXY_MIN_FREE_GB)")
        return None

    def entries(self, keep: set[str], sidecars: list[dict] | None = None
                ) -> tuple[list[Entry], int]:
        """Evictable files, and the bytes of every file in the folder (kept ones included)."""
        sidecars = self.store.sidecars() if sidecars is None else sidecars
        saved = {s["stem"]: s for s in sidecars if s.get("saved_at")}
        found, total = [], 0
        paths = [p for suffix in SAVED_SUFFIXES for p in self.store.root.glob(f"*{suffix}")]
        own: dict[str, int] = {}
        if self.shared is not None:
            total, own = self.shared.usage()
        orphans = orphan_companions(self.store.root)
        quarantined = self.store.root / QUARANTINE_DIR
        indexes = {self.store.root: companion_index(self.store.root),
                   quarantined: companion_index(quarantined)}
        if quarantined.is_dir():
            paths += [p for p in quarantined.iterdir() if p.name.endswith(SAVED_SUFFIXES)]
            orphans += orphan_companions(quarantined)
        for path in orphans:   # a companion without its file: loose
            try:
                stat = path.stat()
            except OSError:
                continue
            total += stat.st_size
            used = datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat()
            found.append(Entry(path, stat.st_size, used, None, loose=True))
        for path in paths:
            try:
                stat = path.stat()
            except OSError:
                continue
            # the file and what llama-server wrote beside it
            size = bytes_with_companions(path, indexes.get(path.parent))
            total += size
            if path.parent == self.store.root and is_leftover(path.name):
                continue   # a save being written (or one a crash left: the start-up sweep's)
            stem = saved_stem(path)
            sidecar = saved.get(stem) if path.parent == self.store.root else None
            if sidecar and not is_leftover(path.name):
                if stem in keep:
                    continue
                used = sidecar.get("last_used_at") or sidecar.get("saved_at") or ""
                # what evicting it frees: its own file, and the chunks no other session names
                found.append(Entry(path, size + own.get(stem, 0), used, stem, loose=False))
            else:
                used = datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat()
                found.append(Entry(path, size, used, None, loose=True))
        return found, total

    def estimate(self, stem: str, tokens: int, made_by: dict | None,
                 sidecars: list[dict] | None = None) -> int:
        """Bytes a save of ``tokens`` will take (companions included): bytes per token of
        this session's last save, else the largest seen for the same model, else unknown (0)."""
        if tokens <= 0:
            return 0
        ratios: list[float] = []
        for sidecar in self.store.sidecars() if sidecars is None else sidecars:
            n_tokens, n_bytes = sidecar.get("n_tokens"), sidecar.get("saved_bytes")
            if not (isinstance(n_tokens, int) and n_tokens > 0 and isinstance(n_bytes, int)):
                continue
            n_bytes += sum(v for v in (sidecar.get("companions") or {}).values()
                           if isinstance(v, int))
            if sidecar["stem"] == stem:
                return int(tokens * n_bytes / n_tokens)
            if made_by is None or sidecar.get("made_by") == made_by:
                ratios.append(n_bytes / n_tokens)
        return int(tokens * max(ratios)) if ratios else 0

    def make_room(self, stem: str, tokens: int, made_by: dict | None, keep: set[str]) -> int:
        """Before a save of ``tokens``: evict so it fits, or raise StorageError and delete
        nothing. One scan of the sidecars serves the estimate and the plan; returns the
        estimate."""
        sidecars = self.store.sidecars()
        incoming = self.estimate(stem, tokens, made_by, sidecars)
        if not self.max_bytes and not self.min_free and not incoming:
            return incoming
        with self._pins_lock:   # chosen and deleted while no swap can pin a file
            entries, total = self.entries(keep | set(self._pins), sidecars)
            free, floor = self.free_bytes(), self.floor()
            victims, fits = plan_eviction(entries, total=total, incoming=incoming,
                                          replacing=self.store.disk_bytes(stem), free=free,
                                          max_bytes=self.max_bytes, min_free=floor)
            if not fits:
                raise SaveFailed(
                    f"no room to save {stem}.bin: {shown(free or 0)} free on the slot folder's "
                    f"filesystem, the save needs about {shown(incoming)} and {shown(floor)} is "
                    f"kept free (KVPROXY_MIN_FREE_GB, at most {MAX_FREE_SHARE:.0%} of the "
                    f"filesystem)")
            self._delete(victims, "to make room for a save")
        return incoming

    def trim(self, keep: set[str]) -> None:
        """After a save: back within the folder bound if the estimate was short."""
        if not self.max_bytes:
            return
        with self._pins_lock:
            entries, total = self.entries(keep | set(self._pins))
            victims, _ = plan_eviction(entries, total=total, incoming=0, replacing=0,
                                       free=None, max_bytes=self.max_bytes, min_free=0)
            self._delete(victims, "the slot folder is over its bound")

    def _delete(self, victims: list[Entry], why: str) -> None:
        for entry in victims:
            try:
                if entry.stem:
                    self.store.delete(entry.stem)
                else:
                    unlink_with_companions(entry.path)
                    if entry.path.parent != self.store.root and \
                            entry.path.name.endswith(SAVED_SUFFIXES):   # a quarantined file's sidecar
                        entry.path.with_name(saved_stem(entry.path) + ".json").unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not evict %s: %s", entry.path.name, exc)
                continue
            log.info("evicted %s (%d bytes): %s", entry.path.name, entry.size, why)
            metrics.observe_eviction(entry.size)
        if victims and self.shared is not None:
            self.shared.free()   # the chunks only the evicted sessions named
