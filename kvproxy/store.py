"""Slot files and their JSON sidecars in the slot folder.

Each session or base snapshot is ``<stem>.bin`` (written by llama-server)
plus ``<stem>.json`` (written here, atomically: temp file, then rename).
A small state file remembers which session the slot holds, so a restarted
proxy, or a second worker, knows what to save before the next swap.

Sidecars carry a format number; ``migrate_sidecar`` lifts every older format
to the current one step by step, so files saved by an older kvproxy still load.
"""
from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SIDECAR_FORMAT = 2
STATE_FILE = ".kvproxy-state.json"
LOCK_FILE = ".kvproxy.lock"
TEMP_SUFFIX = ".saving.bin"     # a save in progress: <stem>.saving.bin
PROBE_PREFIX = "probe."         # the start-up check's probe file: probe.<hex>.bin
QUARANTINE_DIR = "quarantine"   # files that cannot be trusted, moved aside


class StorageError(RuntimeError):
    """The slot folder cannot take a save: disk full, folder unwritable, a short write.

    Clients get 503 with Retry-After; nothing already on disk was changed.
    """

    retry_after = 30


def _v1_to_v2(sidecar: dict) -> dict:
    """Format 2 records the size of the file as checked on disk (``saved_bytes``).
    Format 1 recorded only llama-server's own count (``n_bytes``): take that as the
    expected size, so a truncated old file is caught by the same check."""
    if sidecar.get("saved_at") and sidecar.get("n_bytes"):
        sidecar["saved_bytes"] = int(sidecar["n_bytes"])
    return sidecar


MIGRATIONS = {1: _v1_to_v2}  # format n -> format n + 1


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


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so a reader sees the old file or the new one, never half of one.

    No fsync: it cost milliseconds on every request, and these files are
    bookkeeping that readers already tolerate losing (a missing sidecar only
    means the slot file is not restored).
    """
    tmp = write_json_beside(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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


class SessionStore:
    """The slot folder: sidecars, slot files and the proxy's state file."""

    def __init__(self, slot_dir: str | os.PathLike):
        self.root = Path(slot_dir)
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def lock_path(self) -> Path:
        return self.root / LOCK_FILE

    def bin_path(self, stem: str) -> Path:
        return self.root / f"{stem}.bin"

    def sidecar_path(self, stem: str) -> Path:
        return self.root / f"{stem}.json"

    def has_bin(self, stem: str) -> bool:
        return self.bin_path(stem).is_file()

    def bin_bytes(self, stem: str) -> int:
        try:
            return self.bin_path(stem).stat().st_size
        except FileNotFoundError:
            return 0

    # -- sidecars ----------------------------------------------------------
    def read_sidecar(self, stem: str) -> dict | None:
        return migrate_sidecar(read_json(self.sidecar_path(stem)))

    def update_sidecar(self, stem: str, defaults: dict, count: str | None = None,
                       **changes: Any) -> dict:
        """Merge ``changes`` into the sidecar, creating it from ``defaults`` if absent;
        ``count`` names a counter to add one to, in the same read and write."""
        sidecar = self.merged_sidecar(stem, defaults, **changes)
        if count:
            sidecar[count] = int(sidecar.get(count) or 0) + 1
        _write_or_storage_error(self.sidecar_path(stem), sidecar)
        return sidecar

    def merged_sidecar(self, stem: str, defaults: dict, **changes: Any) -> dict:
        """The sidecar with ``changes``, not written (a save writes it with its file)."""
        sidecar = self.read_sidecar(stem) or {"format": SIDECAR_FORMAT, "stem": stem,
                                              "created_at": now_iso(), "hits": 0, **defaults}
        sidecar.update(changes)
        return sidecar

    def sidecars(self) -> list[dict]:
        """Every sidecar in the folder, with the real size of its slot file."""
        found = []
        for path in sorted(self.root.glob("*.json")):
            sidecar = migrate_sidecar(read_json(path))
            if sidecar:
                sidecar["file_bytes"] = self.bin_bytes(path.stem)
                found.append(sidecar)
        return found

    def delete(self, stem: str) -> bool:
        """Remove a slot file and its sidecar; False when neither existed."""
        removed = False
        for path in (self.bin_path(stem), self.sidecar_path(stem)):
            try:
                path.unlink()
                removed = True
            except FileNotFoundError:
                pass
        return removed

    # -- proxy state -------------------------------------------------------
    def read_state(self) -> dict:
        return read_json(self.root / STATE_FILE) or {}

    def write_state(self, state: dict) -> None:
        _write_or_storage_error(self.root / STATE_FILE, state)


def _write_or_storage_error(path: Path, data: Any) -> None:
    try:
        write_json_atomic(path, data)
    except OSError as exc:
        raise StorageError(f"cannot write {path.name} in the slot folder: {exc.strerror or exc}") from exc
