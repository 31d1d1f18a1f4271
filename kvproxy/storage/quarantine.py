"""Files that do not match their sidecar: judged, and moved to ``quarantine/`` instead of
being restored (with their companions and sidecar, and the reason). Nothing is deleted
here: the folder's disk budget evicts quarantined files first."""
from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from kvproxy.storage.store import (CHUNKED_SUFFIX, QUARANTINE_DIR, SessionStore, StorageError,
                                   companion_suffixes, move_companions, now_iso, read_json,
                                   write_json_atomic)


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
    if store.bin_path(stem).exists() or not store.chunked_path(stem).exists():
        os.replace(store.bin_path(stem), target)
        move_companions(store.bin_path(stem), target)
    else:   # stored as chunks: the manifest goes (its chunks are freed once nothing names them)
        target = folder / f"{stem}.{tag}{CHUNKED_SUFFIX}"
        os.replace(store.chunked_path(stem), target)
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


def set_aside(store: SessionStore, stem: str, reason: str,
              check: Callable[[SessionStore, str], tuple[dict | None, str | None]] = file_check
              ) -> str:
    """Quarantine a file that will not be restored; says where it went, for the log. Only a
    mismatch still there under the stem's lock (``check``): the file may have been replaced
    by a good save since it was judged, and that must not go."""
    try:
        with store.stem_lock(stem):
            sidecar, problem = check(store, stem)
            if sidecar and sidecar.get("saved_at") and problem is None:
                return "kept: it matches its sidecar when read again (a save was put in place)"
            quarantine(store, stem, reason)
    except (OSError, StorageError) as exc:
        return f"it could not be moved aside ({exc})"
    return f"moved to {QUARANTINE_DIR}/"
