"""Slot files and their JSON sidecars in the slot folder.

Each session or base snapshot is ``<stem>.bin`` (written by llama-server)
plus ``<stem>.json`` (written here, atomically: temp file, then rename).
llama-server may write companion files beside a slot file, ``<stem>.bin.<suffix>``
(newer llama-server saves context checkpoints as ``<stem>.bin.ckpt``): they belong
to the slot file, are counted in its size on disk, and are moved, quarantined,
evicted and deleted with it (``companions``). A save's renames and each sidecar
update of one stem hold that stem's lock (``stem_lock``), so no reader sees, and no
update writes back, a file and a sidecar of two different saves. What answers teach a
sidecar (hits, last use, trail) is held in memory and written at most once a second per
session (``notes.HeldNotes``); this process's readers see it merged.
A small state file holds a table with one entry per slot: which session the
slot holds, how many tokens, when it was last used. A restarted proxy, or a
second worker, reads it to know what to save before the next swap. Each entry
is written under its slot's lock; the table as a whole is read, changed and
written under a short lock of its own, so processes changing different slots
never lose each other's entries.

Sidecars and the state file carry a format number; ``migrate_sidecar`` and
``migrate_state`` lift every older format to the current one step by step, so
files written by an older kvproxy still load (format 1 of the state file
described a single slot: it becomes that slot's entry; format 3 names each
slot's phase, see ``slots.state``). A state file from a newer kvproxy is
refused loudly (``StateFormatError``): guessing at it could save an unproven
slot over a session's file.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import stat
import tempfile
import threading
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import filelock

from kvproxy.storage.notes import HeldNotes

from kvproxy.sessions.identity import model_tag
from kvproxy.storage.chunks import manifest
from kvproxy.upstream import slot_file

from kvproxy.errors import StateFormatError, StorageError, map_exceptions  # noqa: F401 - both also imported from here

SIDECAR_FORMAT = 3
STATE_FORMAT = 3
STATE_FILE = ".kvproxy-state.json"
STATE_LOCK = ".kvproxy-state.lock"
SAVE_LOCK = ".kvproxy-save.lock"  # one save at a time per folder and model
LOCK_FILE = ".kvproxy.lock"     # slot 0's lock (the name older versions used for their one slot)
TEMP_SUFFIX = ".saving.bin"     # a save in progress: <stem>.saving.bin
RESTORING_SUFFIX = ".restoring.bin"  # a file put together from chunks for one restore
CHUNKED_SUFFIX = ".chunked"     # a session stored as chunks: its manifest and own tail
CHUNK_DIR = "chunks"            # the chunks, of every model
CHUNK_LOCK = ".kvproxy-chunks.lock"  # held while chunks are named (a cut) or freed
PROBE_PREFIX = "probe."         # the start-up check's probe file: probe.<hex>.bin
QUARANTINE_DIR = "quarantine"   # files that cannot be trusted, moved aside
STEM_LOCKS = 16                 # .kvproxy-files-<n>.lock: a stem's lock is one of these
SLOT_SUFFIX = ".bin"            # a slot file; its companions are <name>.bin.<suffix>


def companions(path: Path) -> list[Path]:
    """The companion files llama-server wrote beside the slot file ``path``:
    ``<path>.<suffix>`` (``<stem>.bin.ckpt``), whether or not ``path`` itself exists."""
    path = Path(path)
    try:
        return sorted(p for p in path.parent.glob(f"{glob.escape(path.name)}.*")
                      if p.is_file() and p.name != path.name)
    except OSError:
        return []


def companion_suffixes(path: Path) -> dict[str, int]:
    """``{suffix: bytes}`` of the companions of ``path`` (``{".ckpt": 1234}``)."""
    found = {}
    for companion in companions(path):
        try:
            found[companion.name[len(Path(path).name):]] = companion.stat().st_size
        except OSError:
            continue
    return found


def slot_file_of(name: str) -> str | None:
    """The slot file a companion's name belongs to (``x.bin.ckpt`` -> ``x.bin``); None when
    ``name`` is not a companion."""
    cut = name.find(SLOT_SUFFIX + ".")
    return name[:cut + len(SLOT_SUFFIX)] if cut > 0 else None


def companion_index(folder: Path) -> dict[str, list[str]]:
    """The names of every companion in ``folder``, by the slot file they belong to: one
    listing for callers that look at every file (``companions`` lists the folder each time,
    which over a thousand sessions took seconds)."""
    index: dict[str, list[str]] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return index
    for name in names:
        owner = slot_file_of(name)
        if owner is not None and name != owner:
            index.setdefault(owner, []).append(name)
    return index


def bytes_with_companions(path: Path, index: dict[str, list[str]] | None = None) -> int:
    """A slot file's bytes on disk with its companions' (0 for what is gone); ``index``: the
    folder's ``companion_index``, when the caller made one."""
    path = Path(path)
    found = companions(path) if index is None else \
        [path.parent / name for name in index.get(path.name, ())]
    total = 0
    for part in (path, *found):
        try:
            st = part.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def move_companions(src: Path, dst: Path, keep: set[str] | None = None) -> None:
    """Rename the companions of ``src`` to those of ``dst`` (after ``src`` itself was renamed
    to ``dst``). With ``keep`` (suffixes), companions of ``dst`` neither moved nor kept are
    deleted then: what the file it replaced had. Run again after a crash, it finishes."""
    moved = set()
    for companion in companions(src):
        suffix = companion.name[len(Path(src).name):]
        os.replace(companion, Path(dst).with_name(Path(dst).name + suffix))
        moved.add(suffix)
    if keep is None:
        return
    wanted = moved | set(keep)
    for companion in companions(dst):
        if companion.name[len(Path(dst).name):] not in wanted:
            companion.unlink(missing_ok=True)


def unlink_with_companions(path: Path) -> bool:
    """Delete a slot file, then its companions; False when none of them existed."""
    removed = False
    for part in (Path(path), *companions(path)):
        try:
            part.unlink()
            removed = True
        except FileNotFoundError:
            pass
    return removed



def _v1_to_v2(sidecar: dict) -> dict:
    """Format 2 records the size of the file as checked on disk (``saved_bytes``).
    Format 1 recorded only llama-server's own count (``n_bytes``): take that as the
    expected size, so a truncated old file is caught by the same check."""
    if sidecar.get("saved_at") and sidecar.get("n_bytes"):
        sidecar["saved_bytes"] = int(sidecar["n_bytes"])
    return sidecar


def _v2_to_v3(sidecar: dict) -> dict:
    """Format 3 names the model whose file it is (``model``: its tag, which the file's name
    carries too; ``storage.model_names`` renames older files at start-up)."""
    sidecar.setdefault("model", model_tag((sidecar.get("made_by") or {}).get("model_path")))
    return sidecar


MIGRATIONS = {1: _v1_to_v2, 2: _v2_to_v3}  # format n -> format n + 1


def migrate_sidecar(data: dict | None) -> dict | None:
    """The sidecar in the current format; None for anything that is not a sidecar
    (the state file) or comes from a newer kvproxy."""
    if not data or not isinstance(data.get("format"), int) or "stem" not in data:
        return None
    while data["format"] < SIDECAR_FORMAT:
        step = MIGRATIONS.get(data["format"])
        if step is None:
            return None
        data = step(dict(data))
        data["format"] += 1
    return data if data["format"] == SIDECAR_FORMAT else None


def _state_v1_to_v2(state: dict, legacy_slot: int) -> dict:
    """Format 1 described the one slot kvproxy drove (``KVPROXY_SLOT_ID``): it becomes
    that slot's entry of the table, so the session it held is still saved before a swap."""
    entry = {k: v for k, v in state.items() if k != "format"}
    return {"slots": {str(legacy_slot): entry} if entry else {}}


def _state_v2_to_v3(state: dict, legacy_slot: int) -> dict:
    """Format 3 names each slot's phase (``slots.state.Phase``) instead of the two flags
    ``slot_unknown`` (nothing there trusted) and ``unsaved`` (turns its file lacks)."""
    slots = {}
    for slot, entry in (state.get("slots") or {}).items():
        if not isinstance(entry, dict):
            continue
        entry = dict(entry)
        unknown, unsaved = entry.pop("slot_unknown", False), entry.pop("unsaved", False)
        if unknown:
            entry["phase"] = "unproven"
        elif not (entry.get("active") and entry.get("active_key")):
            entry["phase"] = "empty"
        else:
            entry["phase"] = "unsaved" if unsaved else "ours"
        slots[slot] = entry
    return {"slots": slots}


STATE_MIGRATIONS = {1: _state_v1_to_v2, 2: _state_v2_to_v3}  # format n -> format n + 1


def migrate_state(data: dict | None, legacy_slot: int = 0) -> dict:
    """The state file in the current format: ``{"format": 3, "slots": {"<id>": entry}}``.
    One that is not a table gives an empty table (every slot then holds nothing kvproxy
    trusts or saves); one from a newer kvproxy raises ``StateFormatError``."""
    data = dict(data or {})
    if not data:
        return {"format": STATE_FORMAT, "slots": {}}
    version = data.get("format", 1)
    if isinstance(version, int) and version > STATE_FORMAT:
        raise StateFormatError(
            f"the state file {STATE_FILE} in the slot folder was written by a newer kvproxy "
            f"(format {version}; this one reads formats 1 to {STATE_FORMAT}): run that kvproxy, "
            f"or move the file aside (every slot then starts unproven)")
    while isinstance(version, int) and version < STATE_FORMAT:
        step = STATE_MIGRATIONS.get(version)
        if step is None:
            break
        data = step(data, legacy_slot)
        version += 1
    if version != STATE_FORMAT or not isinstance(data.get("slots"), dict):
        return {"format": STATE_FORMAT, "slots": {}}
    return {"format": STATE_FORMAT,
            "slots": {k: v for k, v in data["slots"].items() if isinstance(v, dict)}}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def write_json_atomic(path: Path, data: Any) -> tuple[int, int]:
    """Write JSON so a reader sees the old file or the new one, never half of one.
    Returns the file's (modification time in ns, size): a listing of the folder shows
    these until someone writes it again.

    No fsync: it cost milliseconds on every request, and these files are
    bookkeeping that readers already tolerate losing (a missing sidecar only
    means the slot file is not restored).
    """
    tmp = write_json_beside(path, data)
    try:
        written = os.stat(tmp)  # a rename keeps both
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written.st_mtime_ns, written.st_size


def write_json_beside(path: Path, data: Any) -> Path:
    """Write JSON to a temporary file next to ``path``, for the caller to rename over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# filelock.Timeout is an OSError: it comes first.
TABLE_LOCK_FAILURES = {
    filelock.Timeout: lambda exc: StorageError("the state file's lock stayed taken for 30 s"),
    OSError: lambda exc: StorageError(f"cannot lock the state file: {exc.strerror or exc}")}

STEM_LOCK_FAILURES = {
    filelock.Timeout: lambda exc: StorageError("a slot file's lock stayed taken for 30 s"),
    OSError: lambda exc: StorageError(f"cannot lock a slot file: {exc.strerror or exc}")}


class SessionStore:
    """The slot folder: sidecars, slot files and the proxy's state file."""

    def __init__(self, slot_dir: str | os.PathLike, legacy_slot: int = 0,
                 model: str | None = None, notes: HeldNotes | None = None):
        self.root = Path(slot_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        # The slot a format-1 state file described, and the one read_state() means by default.
        self.legacy_slot = legacy_slot
        # Behind llama-server's router each model has slots of its own: their table and locks
        # carry the model's tag (``.kvproxy-state@<model>.json``); files always carry it.
        self.model = model
        self.state_file = self.root / self._scoped(STATE_FILE)
        self._table_thread_lock = threading.Lock()
        self._table_file_lock = filelock.FileLock(str(self.root / self._scoped(STATE_LOCK)),
                                                  thread_local=False)
        self._sidecar_readers: list[Callable[[str, tuple[int, int], dict], None]] = []
        self._sidecar_forgetters: list[Callable[[str], None]] = []
        # Per-stem locks, a fixed set the stems hash onto (no lock file per session to clean).
        self._stem_locks = [(threading.RLock(), filelock.FileLock(
            str(self.root / f".kvproxy-files-{n}.lock"), thread_local=False))
            for n in range(STEM_LOCKS)]
        # Notes of answers not yet in their sidecars: one per folder, shared by every
        # model's store (``for_model``).
        self.notes = notes if notes is not None else HeldNotes(self.write_held)

    def for_model(self, model: str | None) -> "SessionStore":
        """The store of ``model``'s files in this folder, sharing this store's held notes."""
        return SessionStore(self.root, model=model, notes=self.notes)

    def _scoped(self, name: str) -> str:
        if not self.model:
            return name
        stem, dot, suffix = name.rpartition(".")
        return f"{stem}@{self.model}{dot}{suffix}"

    @property
    def lock_path(self) -> Path:
        return self.slot_lock_path(self.legacy_slot)

    def slot_lock_path(self, slot: int) -> Path:
        """The cross-process lock of one slot."""
        return self.root / self._scoped(LOCK_FILE if slot == 0 else f".kvproxy-slot{int(slot)}.lock")

    @property
    def save_lock_path(self) -> Path:
        """The cross-process lock around saves into this folder (``budget.DiskBudget.saving``)."""
        return self.root / self._scoped(SAVE_LOCK)

    def bin_path(self, stem: str) -> Path:
        return self.root / f"{stem}.bin"

    def chunked_path(self, stem: str) -> Path:
        """The session stored as chunks (``storage.chunks``): its manifest and own tail."""
        return self.root / f"{stem}{CHUNKED_SUFFIX}"

    @property
    def chunk_root(self) -> Path:
        """One folder of chunks for every model (their keys are seeded with the model's
        fingerprint): a model's sessions find their chunks whichever switch saved them."""
        return self.root / CHUNK_DIR

    def has_companions(self, stem: str) -> bool:
        return bool(companions(self.bin_path(stem)))

    def saved_tokens(self, stem: str) -> list[int] | None:
        """The tokens of a saved session, from its whole file or its manifest."""
        if self.bin_path(stem).is_file():
            return slot_file.tokens(self.bin_path(stem))
        return manifest.tokens(self.chunked_path(stem))

    def sidecar_path(self, stem: str) -> Path:
        return self.root / f"{stem}.json"

    def has_bin(self, stem: str) -> bool:
        """Whether a save of ``stem`` is stored: its whole file or its manifest."""
        return self.bin_path(stem).is_file() or self.chunked_path(stem).is_file()

    def bin_bytes(self, stem: str) -> int:
        """The slot file's own size (what llama-server reports writing), also when it is
        stored as chunks (the size its manifest puts back together)."""
        try:
            return self.bin_path(stem).stat().st_size
        except FileNotFoundError:
            return manifest.file_size(self.chunked_path(stem))

    def saved_name(self, stem: str, sidecar: dict | None = None) -> str:
        """The name of a session's own file in the folder: ``<stem>.bin``, or
        ``<stem>.chunked`` when its last save is stored as chunks."""
        sidecar = self.read_sidecar(stem) if sidecar is None else sidecar
        return f"{stem}{CHUNKED_SUFFIX}" if (sidecar or {}).get("stored_as") == "chunks" \
            else f"{stem}.bin"

    def disk_bytes(self, stem: str, index: dict[str, list[str]] | None = None) -> int:
        """What the session's own files take on disk: the slot file and its companions, or
        its manifest and tail (chunks, shared, are counted apart). ``index``: the folder's
        ``companion_index``, when the caller made one."""
        own = bytes_with_companions(self.bin_path(stem), index)
        try:
            return own + self.chunked_path(stem).stat().st_size
        except OSError:
            return own

    @contextlib.contextmanager
    def stem_lock(self, stem: str) -> Iterator[None]:
        """Hold ``stem``'s lock: a save being put in place (file renamed, then sidecar) and a
        sidecar's read-modify-write exclude each other, between threads and processes, so
        nobody judges or rewrites a file and a sidecar of two different saves. Re-entrant
        in one thread (a thread lock first: filelock with ``thread_local=False`` is
        re-entrant across threads). The stem picks one of ``STEM_LOCKS`` by a hash that is
        the same in every process (``hash()`` of a str is not)."""
        thread_lock, file_lock = self._stem_locks[zlib.crc32(stem.encode()) % STEM_LOCKS]
        if not thread_lock.acquire(timeout=30):
            raise StorageError("a slot file's lock stayed taken for 30 s in this process")
        try:
            with map_exceptions(STEM_LOCK_FAILURES):
                file_lock.acquire(timeout=30)
            try:
                yield
            finally:
                file_lock.release()
        finally:
            thread_lock.release()

    # -- sidecars ----------------------------------------------------------
    def read_sidecar(self, stem: str) -> dict | None:
        """The sidecar as this process knows it: the file with the notes held for it."""
        return self._with_held(stem, self._sidecar_on_disk(stem))

    def _sidecar_on_disk(self, stem: str) -> dict | None:
        return migrate_sidecar(read_json(self.sidecar_path(stem)))

    def _with_held(self, stem: str, sidecar: dict | None) -> dict | None:
        note = self.notes.peek(stem)
        if note is None:
            return sidecar
        return note.applied(sidecar if sidecar is not None else self._new_sidecar(stem, note.defaults))

    def _new_sidecar(self, stem: str, defaults: dict) -> dict:
        return {"format": SIDECAR_FORMAT, "stem": stem, "created_at": now_iso(), "hits": 0,
                **defaults}

    def note_use(self, stem: str, defaults: dict, count: tuple[str, ...] = (),
                 **fields: Any) -> None:
        """What an answer teaches the sidecar (``count`` adds one to each counter named,
        ``fields`` are set; ``defaults`` start a sidecar that does not exist): held, and
        written now only when the stem's notes were not written in the last second
        (``notes.HeldNotes``)."""
        if self.notes.hold(stem, defaults, count, fields):
            self.write_held(stem)

    def write_held(self, stem: str) -> None:
        """Write the notes held for ``stem`` into its sidecar (nothing when none are)."""
        if self.notes.peek(stem) is not None:
            self.update_sidecar(stem, {})

    def tell_sidecar_writes(self, reader: Callable[[str, tuple[int, int], dict], None],
                            forget: Callable[[str], None] | None = None) -> None:
        """Hand ``reader`` each sidecar ``update_sidecar`` writes: its file name, (modification
        time in ns, size) and content; and ``forget`` the file name of each sidecar ``delete``
        removes. An index of the folder then need not read back what this process wrote, nor
        list the folder to learn what it deleted."""
        if reader not in self._sidecar_readers:
            self._sidecar_readers.append(reader)
        if forget is not None and forget not in self._sidecar_forgetters:
            self._sidecar_forgetters.append(forget)

    def update_sidecar(self, stem: str, defaults: dict, count: str | tuple[str, ...] = (),
                       of_save: str | None = None, **changes: Any) -> dict | None:
        """Merge ``changes`` into the sidecar, creating it from ``defaults`` if absent;
        ``count`` names the counters to add one to, in the same read and write, under the
        stem's lock (a save put in place meanwhile is never overwritten by the sidecar read
        before it). ``of_save``: the ``saved_at`` of the save the changes are about; when
        the sidecar describes another save by then, nothing is written (None): a refusal of
        the old file must not stick to the new one."""
        path = self.sidecar_path(stem)
        counts = (count,) if isinstance(count, str) else count
        with self.stem_lock(stem):
            held = self.notes.take(stem)   # written with these changes, or held again
            try:
                sidecar = self.merged_sidecar(stem, {**(held.defaults if held else {}),
                                                     **defaults})
                if of_save is not None and sidecar.get("saved_at") != of_save:
                    if held is not None:
                        self.notes.put_back(stem, held)
                    return None
                if held is not None:
                    held.applied(sidecar)
                sidecar.update(changes)
                for name in counts:
                    sidecar[name] = int(sidecar.get(name) or 0) + 1
                written = _write_or_storage_error(path, sidecar)
            except BaseException:
                if held is not None:
                    self.notes.put_back(stem, held)
                raise
        for reader in self._sidecar_readers:
            reader(path.name, written, sidecar)
        return sidecar

    def merged_sidecar(self, stem: str, defaults: dict, **changes: Any) -> dict:
        """The sidecar file with ``changes``, not written (a save writes it with its file).
        Without the held notes: they are written on their own, added to what is there then."""
        sidecar = self._sidecar_on_disk(stem) or self._new_sidecar(stem, defaults)
        sidecar.update(changes)
        return sidecar

    def sidecars(self) -> list[dict]:
        """Every sidecar in the folder, with the real size of its slot file on disk
        (companions included)."""
        found = []
        index = companion_index(self.root)
        for path in sorted(self.root.glob("*.json")):
            sidecar = self._with_held(path.stem, migrate_sidecar(read_json(path)))
            if sidecar:
                sidecar["file_bytes"] = self.disk_bytes(path.stem, index)
                found.append(sidecar)
        return found

    def sidecar_files(self) -> list[tuple[str, int, int]]:
        """Every sidecar's (file name, modification time in ns, size), unread: an index of the
        folder rereads (``read_sidecar``) only those that changed. Hidden files (the state
        file, temporary ones) are not sidecars."""
        try:
            entries = [e for e in os.scandir(self.root)
                       if e.name.endswith(".json") and not e.name.startswith(".")]
        except OSError:
            return []
        found = []
        for entry in entries:
            try:
                st = entry.stat()
            except OSError:
                continue
            found.append((entry.name, st.st_mtime_ns, st.st_size))
        return found

    def delete(self, stem: str) -> bool:
        """Remove a slot file, its companions and its sidecar (in that order: a crash leaves
        what the start-up sweep deletes); False when none existed."""
        self.notes.drop(stem)
        removed = unlink_with_companions(self.bin_path(stem))
        try:
            self.chunked_path(stem).unlink()
            removed = True
        except FileNotFoundError:
            pass
        try:
            self.sidecar_path(stem).unlink()
            removed = True
        except FileNotFoundError:
            pass
        for forget in self._sidecar_forgetters:
            forget(self.sidecar_path(stem).name)
        return removed

    # -- proxy state: one entry per slot ----------------------------------
    def state_key(self) -> tuple | None:
        """What tells one state file from the next: every write renames a new file (a new
        inode, new times) over it. None when there is none."""
        try:
            st = os.stat(self.state_file)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def read_table(self) -> dict[int, dict]:
        """Every slot's entry, by slot id (older state files migrated on the fly)."""
        table = migrate_state(read_json(self.state_file), self.legacy_slot)["slots"]
        found = {}
        for key, entry in table.items():
            try:
                found[int(key)] = entry
            except ValueError:
                continue
        return found

    def held_stems(self) -> set[str]:
        """The files every state table in the folder names (each model's, behind a router): a
        slot may be saved over its file, so no model's disk budget may evict it."""
        held = set()
        for path in self.root.glob(STATE_FILE.replace(".json", "*.json")):
            for entry in migrate_state(read_json(path), self.legacy_slot)["slots"].values():
                if isinstance(entry.get("active_stem"), str):
                    held.add(entry["active_stem"])
        return held

    def read_state(self, slot: int | None = None) -> dict:
        """The entry of one slot (default: the first slot kvproxy drives); {} when none."""
        return dict(self.read_table().get(self.legacy_slot if slot is None else slot) or {})

    def write_state(self, state: dict, slot: int | None = None) -> None:
        """Replace one slot's entry, leaving the other slots' entries as they are."""
        self.change_table(lambda table: table.__setitem__(
            self.legacy_slot if slot is None else slot, dict(state)))

    def change_table(self, change: Callable[[dict[int, dict]], Any]) -> Any:
        """Read the table, let ``change`` edit it in place, write it; all under the table's
        own short lock. Returns what ``change`` returned."""
        with map_exceptions(TABLE_LOCK_FAILURES), self._table_thread_lock, \
                self._table_file_lock.acquire(timeout=30):
            table = self.read_table()
            result = change(table)
            _write_or_storage_error(self.state_file, {
                "format": STATE_FORMAT,
                "slots": {str(k): v for k, v in sorted(table.items())}})
            return result

    def migrate_state_file(self) -> bool:
        """Write an older state file in the current format (at start); True when it changed."""
        raw = read_json(self.state_file)
        if not raw or raw.get("format") == STATE_FORMAT:
            return False
        self.change_table(lambda table: None)
        return True


def _write_or_storage_error(path: Path, data: Any) -> tuple[int, int]:
    with map_exceptions({OSError: lambda exc: StorageError(
            f"cannot write {path.name} in the slot folder: {exc.strerror or exc}")}):
        return write_json_atomic(path, data)
