"""The slot folder's disk side: checked saves, quarantine, the start-up sweep, the disk budget.

llama-server overwrites a slot file in place and reports what it wrote, without
fsync; a full disk can leave a short file behind a success answer. So a save
goes to a temporary name first, its size on disk is compared with
llama-server's count, and only then is it renamed over the session's file. A
file whose size does not match its sidecar is moved to ``quarantine/`` instead
of being restored. Which files to evict is decided by a pure function,
``plan_eviction``; ``DiskBudget`` carries it out.

Companion files llama-server writes beside a slot file (``<stem>.bin.ckpt``, see
``store.companions``) go wherever their file goes: a checked save renames them in
after the file and before the sidecar (the sidecar records them), quarantine and
eviction move or delete them with it, the sweep treats a companion of a leftover as
a leftover and deletes one whose slot file is gone, and a file's size on disk for the
budget includes them.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import filelock
from datetime import datetime, timedelta, timezone
from pathlib import Path

from kvproxy.telemetry import metrics
from kvproxy.upstream.llama import LlamaClient, UpstreamError
from kvproxy.storage.store import (PROBE_PREFIX, QUARANTINE_DIR, SIDECAR_FORMAT, TEMP_SUFFIX, SessionStore,
                    StorageError, bytes_with_companions, companion_suffixes, companions,
                    migrate_sidecar, move_companions, now_iso, read_json, slot_file_of,
                    unlink_with_companions, write_json_atomic, write_json_beside)

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
# A temporary sidecar as ``write_json_beside`` names it: .<stem>.json.<random>.tmp
TEMP_SIDECAR = re.compile(r"^\.(?P<stem>.+)\.json\.[^.]+\.tmp$")
# A sidecar of a session that has no file yet (its turns not saved: before its first swap or
# save behind, with restoring off, after dropped saves) only counts its requests and keeps
# its trail for matching; the start-up sweep deletes it once the session is this long unused.
IDLE_SIDECAR_DAYS = 30


class SaveFailed(StorageError):
    """A save the slot folder could not take (no room, a failed or short write): the
    session's old file and sidecar are as they were, or both removed."""


class NotAsRecorded(StorageError):
    """llama-server saved another token count than kvproxy recorded in the slot: the slot
    holds something else, so the save is discarded and the old file and sidecar stay."""


# -- one save ----------------------------------------------------------------
def temp_path(store: SessionStore, stem: str) -> Path:
    """Where llama-server writes a save before it is checked (a name its filename check accepts)."""
    return store.root / f"{stem}{TEMP_SUFFIX}"


def discard(path: Path) -> None:
    """Delete a file (and a slot file's companions), logging what cannot be deleted."""
    try:
        unlink_with_companions(path)
    except OSError as exc:
        log.warning("could not remove %s: %s", path.name, exc)


def checked_save(client: LlamaClient, slot_id: int, store: SessionStore, stem: str,
                 describe: Callable[[dict, int], dict],
                 as_recorded: Callable[[object], bool] = lambda n_saved: True) -> dict | None:
    """Have llama-server save the slot under a temporary name, check it, then put it and its
    sidecar (``describe(answer, size)``) in place. Returns the sidecar, or None when the slot
    is empty (an empty save never replaces a file). A save whose token count
    ``as_recorded`` refuses raises NotAsRecorded; one that llama-server or the folder cannot
    complete raises SaveFailed; both leave the old file and sidecar untouched."""
    tmp = temp_path(store, stem)
    try:
        if tmp.is_file() or tmp.is_symlink() or companions(tmp):  # left by an interrupted save
            unlink_with_companions(tmp)
        answer = client.slot_action(slot_id, "save", tmp.name)
    except (UpstreamError, OSError) as exc:
        discard(tmp)
        reason = exc.message if isinstance(exc, UpstreamError) else exc
        raise SaveFailed(f"could not save {stem}.bin: {reason}; the previous file is kept") from exc
    if not answer.get("n_saved"):
        discard(tmp)
        return None
    if not as_recorded(answer.get("n_saved")):
        discard(tmp)
        raise NotAsRecorded(f"llama-server saved {answer.get('n_saved')} tokens of slot "
                            f"{slot_id}, not what kvproxy recorded there; {stem}.bin is kept "
                            "as it was")
    sidecar = describe(answer, checked_size(store, stem, answer))
    sidecar["companions"] = companion_suffixes(tmp)   # written beside it by llama-server
    install(store, stem, sidecar)
    return sidecar


def checked_size(store: SessionStore, stem: str, answer: dict) -> int:
    """The size of the temporary file when it matches llama-server's count, else StorageError."""
    tmp = temp_path(store, stem)
    try:
        size = tmp.stat().st_size
    except FileNotFoundError:
        raise SaveFailed(f"llama-server reported saving {tmp.name}, but it is not in the slot "
                           f"folder {store.root}: KVPROXY_SLOT_DIR must be the folder of "
                           f"llama-server's --slot-save-path") from None
    written = answer.get("n_written")
    if not isinstance(written, int) or written <= 0 or size != written:
        discard(tmp)
        raise SaveFailed(f"the save of {stem}.bin is incomplete (llama-server wrote {written} "
                           f"bytes, the file has {size}); the previous file is kept")
    return size


def install(store: SessionStore, stem: str, sidecar: dict) -> None:
    """Rename the checked save over ``<stem>.bin``, its companions over the old file's (old
    companions the save has not are deleted), and its new sidecar over the old one.
    Everything that needs disk space happens before the first rename. A process killed
    at any step leaves what ``sweep`` finishes (the new sidecar is written, matching its
    file and naming its companions) or rolls back (the old file, companions and sidecar
    are still in place)."""
    tmp = temp_path(store, stem)
    try:
        tmp_sidecar = write_json_beside(store.sidecar_path(stem), sidecar)
    except OSError as exc:
        discard(tmp)
        raise SaveFailed(f"cannot write the sidecar of {stem}.bin: {exc.strerror or exc}; "
                           f"the previous file is kept") from exc
    try:
        with store.stem_lock(stem):   # nobody reads or rewrites the pair half put in place
            rename_in(store, stem, tmp, tmp_sidecar, sidecar)
    except SaveFailed:
        raise
    except StorageError as exc:       # the lock: nothing renamed yet
        discard(tmp)
        discard(tmp_sidecar)
        raise SaveFailed(f"{exc}; the previous file of {stem}.bin is kept") from exc


def rename_in(store: SessionStore, stem: str, tmp: Path, tmp_sidecar: Path,
              sidecar: dict) -> None:
    """``install``'s renames: the file, its companions, then its sidecar."""
    try:
        os.replace(tmp, store.bin_path(stem))
    except OSError as exc:
        discard(tmp)
        discard(tmp_sidecar)
        raise SaveFailed(f"cannot rename the save of {stem}.bin in the slot folder: "
                           f"{exc.strerror or exc}") from exc
    try:
        move_companions(tmp, store.bin_path(stem), set(sidecar.get("companions") or ()))
        os.replace(tmp_sidecar, store.sidecar_path(stem))
    except OSError as exc:  # the new file does not match the old sidecar: both go
        discard(tmp)
        discard(tmp_sidecar)
        discard(store.bin_path(stem))
        discard(store.sidecar_path(stem))
        raise SaveFailed(f"cannot rename the sidecar of {stem}.bin: {exc.strerror or exc}; "
                           f"the file and its sidecar are removed") from exc


def size_problem(store: SessionStore, stem: str, sidecar: dict) -> str | None:
    """Why ``<stem>.bin`` does not match its sidecar, or None when it does."""
    expected = sidecar.get("saved_bytes")
    if not expected:
        return "its sidecar records no size"
    actual = store.bin_bytes(stem)
    if actual != expected:
        return f"it has {actual} bytes, its sidecar says {expected}"
    found, recorded = companion_suffixes(store.bin_path(stem)), sidecar.get("companions")
    for suffix, size in sorted(recorded.items() if isinstance(recorded, dict) else ()):
        if suffix not in found:
            return f"its companion {stem}.bin{suffix} is missing"
        if found[suffix] != size:
            return (f"its companion {stem}.bin{suffix} has {found[suffix]} bytes, its sidecar "
                    f"says {size}")
    return None


def quarantine(store: SessionStore, stem: str, reason: str) -> Path:
    """Move ``<stem>.bin`` to ``quarantine/`` with its sidecar (and the reason); the session
    starts fresh. Nothing is deleted: the folder's disk bound evicts quarantined files first."""
    folder = store.root / QUARANTINE_DIR
    folder.mkdir(exist_ok=True)
    tag = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    target = folder / f"{stem}.{tag}.bin"
    os.replace(store.bin_path(stem), target)
    move_companions(store.bin_path(stem), target)
    sidecar = read_json(store.sidecar_path(stem)) or {"stem": stem}
    sidecar.update(quarantined_at=now_iso(), quarantine_reason=reason)
    write_json_atomic(folder / f"{stem}.{tag}.json", sidecar)
    store.sidecar_path(stem).unlink(missing_ok=True)
    return target


def file_check(store: SessionStore, stem: str) -> tuple[dict | None, str | None]:
    """``<stem>.bin``'s sidecar, and why the file does not match it (None: it does, or no
    sidecar says what made it). A mismatch is read again under the stem's lock: while a
    save is put in place (its file renamed, its sidecar not yet) a good file looks bad."""
    def read() -> tuple[dict | None, str | None]:
        sidecar = store.read_sidecar(stem)
        if not (sidecar and sidecar.get("saved_at")):
            return sidecar, None
        return sidecar, size_problem(store, stem, sidecar)
    sidecar, problem = read()
    if problem is None:
        return sidecar, None
    with store.stem_lock(stem):
        return read()


def set_aside(store: SessionStore, stem: str, reason: str) -> str:
    """Quarantine a file that will not be restored; says where it went, for the log. Only a
    mismatch still there under the stem's lock: the file may have been replaced by a good
    save since it was judged, and that must not go."""
    try:
        with store.stem_lock(stem):
            sidecar, problem = file_check(store, stem)
            if sidecar and sidecar.get("saved_at") and problem is None:
                return "kept: it matches its sidecar when read again (a save was put in place)"
            quarantine(store, stem, reason)
    except (OSError, StorageError) as exc:
        return f"it could not be moved aside ({exc})"
    return f"moved to {QUARANTINE_DIR}/"


# -- start-up sweep ----------------------------------------------------------
def is_leftover(name: str) -> bool:
    """A temporary file of an interrupted save, probe or sidecar write, or a companion of one
    (``<stem>.saving.bin.ckpt``)."""
    name = slot_file_of(name) or name
    return (name.endswith(TEMP_SUFFIX) or (name.startswith(PROBE_PREFIX) and name.endswith(".bin"))
            or (name.startswith(".") and name.endswith(".tmp")))


def orphan_companions(folder: Path) -> list[Path]:
    """Companion files in ``folder`` whose slot file is gone."""
    try:
        paths = sorted(folder.iterdir())
    except OSError:
        return []
    found = []
    for path in paths:
        owner = slot_file_of(path.name)
        if owner and path.is_file() and not (folder / owner).is_file():
            found.append(path)
    return found


def temp_sidecars(store: SessionStore) -> dict[str, list[Path]]:
    """The temporary sidecars in the folder (``write_json_beside``), by the stem they are for."""
    found: dict[str, list[Path]] = {}
    for path in store.root.iterdir():
        match = TEMP_SIDECAR.match(path.name)
        if match and path.is_file():
            found.setdefault(match["stem"], []).append(path)
    return found


def file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def finish_save(store: SessionStore, stem: str, candidates: list[Path]) -> str | None:
    """Roll an interrupted save of ``stem`` forward: when one of its temporary sidecars
    (newest first) describes a complete save, the checked ``<stem>.saving.bin`` or the
    ``<stem>.bin`` already renamed in, put that file and that sidecar in place. Returns the
    log line, or None: the sweep then deletes the leftovers, and the old pair stays."""
    def newest_first(path: Path) -> float:
        try:
            return -path.stat().st_mtime
        except OSError:
            return 0.0
    def companions_in_place(source: Path, sidecar: dict) -> None:
        move_companions(source, store.bin_path(stem), set(sidecar.get("companions") or ()))
    for candidate in sorted(candidates, key=newest_first):
        sidecar = migrate_sidecar(read_json(candidate))
        if not sidecar or sidecar.get("stem") != stem or not sidecar.get("saved_at"):
            continue
        size = sidecar.get("saved_bytes")
        if not isinstance(size, int) or size <= 0:
            continue
        saving = temp_path(store, stem)
        if file_size(saving) == size:       # killed between the sidecar write and the renames
            os.replace(saving, store.bin_path(stem))
            companions_in_place(saving, sidecar)
            os.replace(candidate, store.sidecar_path(stem))
            return (f"finished the interrupted save of {stem}.bin: its checked file "
                    f"{saving.name} and its sidecar ({size} bytes) put in place")
        if file_size(store.bin_path(stem)) == size:   # killed after the file's rename
            companions_in_place(saving, sidecar)
            os.replace(candidate, store.sidecar_path(stem))
            return (f"finished the interrupted save of {stem}.bin: its new sidecar "
                    f"({size} bytes) put in place")
    return None


def sweep(store: SessionStore) -> list[str]:
    """Clean what a crash or a foreign writer left in the slot folder; one line per action.

    Run with the slot locked. An interrupted save whose temporary sidecar matches
    its file is finished (``finish_save``); other leftover temporary files are
    deleted, which rolls the save back to the old pair; a ``.bin`` without a
    sidecar saying what made it, or whose size (or a recorded companion's) does
    not match, goes to quarantine with its companions; a companion whose slot
    file is gone is deleted; a sidecar whose slot file is gone is deleted (one
    that never had a file goes when ``fileless_sidecar_stale`` says so).
    """
    done = []
    for stem, candidates in sorted(temp_sidecars(store).items()):
        line = finish_save(store, stem, candidates)
        if line:
            done.append(line)
    for path in sorted(store.root.iterdir()):
        if path.is_file() and is_leftover(path.name):
            discard(path)
            done.append(f"deleted leftover temporary file {path.name}")
    for path in sorted(store.root.glob("*.bin")):
        stem = path.stem
        raw = read_json(store.sidecar_path(stem)) or {}
        if isinstance(raw.get("format"), int) and raw["format"] > SIDECAR_FORMAT:
            continue  # written by a newer kvproxy: not ours to judge
        sidecar = store.read_sidecar(stem)
        if not sidecar or not sidecar.get("saved_at"):
            reason = "no sidecar says what made it"
        else:
            reason = size_problem(store, stem, sidecar)
        if reason:
            quarantine(store, stem, reason)
            done.append(f"moved {path.name} to {QUARANTINE_DIR}/: {reason}")
    for path in orphan_companions(store.root):
        discard(path)
        done.append(f"deleted {path.name}: its slot file {slot_file_of(path.name)} is gone")
    for sidecar in store.sidecars():
        stem = sidecar["stem"]
        if store.has_bin(stem):
            continue
        why = "its slot file is gone" if sidecar.get("saved_at") \
            else fileless_sidecar_stale(sidecar, datetime.now(timezone.utc))
        if why:
            store.sidecar_path(stem).unlink(missing_ok=True)
            done.append(f"deleted {stem}.json: {why}")
    return done


def fileless_sidecar_stale(sidecar: dict, now: datetime) -> str | None:
    """Why a sidecar that records no save (and has no file) is deleted, or None: a session's
    keeps its request counts and trail while the session is in use. One that names no
    session was written about a file since gone (a refusal, a restore note), and goes."""
    if not (sidecar.get("session_id") or sidecar.get("hits") or sidecar.get("last_used_at")):
        return "it records neither a save nor a session"
    last = sidecar.get("last_used_at") or sidecar.get("created_at")
    try:
        idle = now - datetime.fromisoformat(last)
    except (TypeError, ValueError):
        return None   # cannot tell: kept
    if idle > timedelta(days=IDLE_SIDECAR_DAYS):
        return f"its session has no file and was last used {idle.days} days ago"
    return None


# -- the disk budget ---------------------------------------------------------
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
        paths = list(self.store.root.glob("*.bin"))
        orphans = orphan_companions(self.store.root)
        quarantined = self.store.root / QUARANTINE_DIR
        if quarantined.is_dir():
            paths += [p for p in quarantined.iterdir() if p.suffix == ".bin"]
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
            size = bytes_with_companions(path)   # the file and what llama-server wrote beside it
            total += size
            if path.parent == self.store.root and is_leftover(path.name):
                continue   # a save being written (or one a crash left: the start-up sweep's)
            sidecar = saved.get(path.stem) if path.parent == self.store.root else None
            if sidecar and not is_leftover(path.name):
                if path.stem in keep:
                    continue
                used = sidecar.get("last_used_at") or sidecar.get("saved_at") or ""
                found.append(Entry(path, size, used, path.stem, loose=False))
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
                    if entry.path.parent != self.store.root and entry.path.suffix == ".bin":
                        # a quarantined file's sidecar
                        entry.path.with_suffix(".json").unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not evict %s: %s", entry.path.name, exc)
                continue
            log.info("evicted %s (%d bytes): %s", entry.path.name, entry.size, why)
            metrics.observe_eviction(entry.size)
