"""The start-up sweep: what a crash or a foreign writer left in the slot folder.

An interrupted save whose temporary sidecar describes a complete file is finished, other
leftovers deleted (the old pair stays), files that do not match their sidecar
quarantined, companions and sidecars whose slot file is gone deleted. A companion of a
leftover is a leftover.
"""
from __future__ import annotations

import os
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

from kvproxy.storage.checked_save import discard, temp_path
from kvproxy.storage.links import materialize
from kvproxy.storage.quarantine import quarantine, size_problem
from kvproxy.storage.store import (CHUNKED_SUFFIX, PROBE_PREFIX, QUARANTINE_DIR, RESTORING_SUFFIX,
                                   SIDECAR_FORMAT, TEMP_SUFFIX,
                                   SessionStore, migrate_sidecar, move_companions, read_json,
                                   slot_file_of)

# A temporary sidecar as ``write_json_beside`` names it: .<stem>.json.<random>.tmp
TEMP_SIDECAR = re.compile(r"^\.(?P<stem>.+)\.json\.[^.]+\.tmp$")
# A sidecar of a session that has no file yet (its turns not saved: before its first swap or
# save behind, with restoring off, after dropped saves) only counts its requests and keeps
# its trail for matching; the start-up sweep deletes it once the session is this long unused.
IDLE_SIDECAR_DAYS = 30


def is_leftover(name: str) -> bool:
    """A temporary file of an interrupted save, probe or sidecar write, or a companion of one
    (``<stem>.saving.bin.ckpt``)."""
    name = slot_file_of(name) or name
    return (name.endswith(TEMP_SUFFIX) or name.endswith(RESTORING_SUFFIX)
            or (name.startswith(PROBE_PREFIX) and name.endswith(".bin"))
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
    for path in sorted(store.root.iterdir()):   # saves written into memory (``chunks.hot``)
        if path.is_symlink() and path.name.endswith(".bin") \
                and not path.name.endswith(RESTORING_SUFFIX):
            done.append(materialize(path))
    for stem, candidates in sorted(temp_sidecars(store).items()):
        line = finish_save(store, stem, candidates)
        if line:
            done.append(line)
    for path in sorted(store.root.iterdir()):
        if (path.is_file() or path.is_symlink()) and is_leftover(path.name):
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
    for path in sorted(store.root.glob(f"*{CHUNKED_SUFFIX}")):
        stem = path.name[:-len(CHUNKED_SUFFIX)]
        if store.bin_path(stem).is_file():   # the whole file is the newer save (``chunks.files``)
            path.unlink(missing_ok=True)
            done.append(f"deleted {path.name}: {stem}.bin beside it is newer")
            named_whole(store, stem)
        elif not (store.read_sidecar(stem) or {}).get("saved_at"):
            quarantine(store, stem, "no sidecar says what made it")
            done.append(f"moved {path.name} to {QUARANTINE_DIR}/: no sidecar says what made it")
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


def named_whole(store: SessionStore, stem: str) -> None:
    """A cut that stopped between naming its manifest in the sidecar and deleting the whole
    file: the whole file is what stays, and the sidecar says so again."""
    sidecar = store.read_sidecar(stem) or {}
    if sidecar.get("stored_as") == "chunks":
        store.update_sidecar(stem, {}, stored_as="file", chunks=None,
                             written_bytes=sidecar.get("saved_bytes"))


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
