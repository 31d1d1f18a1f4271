"""Slot files and their JSON sidecars in the slot folder.

Each session or base snapshot is ``<stem>.bin`` (written by llama-server)
plus ``<stem>.json`` (written here, atomically: temp file, then rename).
A small state file remembers which session the slot holds, so a restarted
proxy, or a second worker, knows what to save before the next swap.
"""
from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SIDECAR_FORMAT = 1
STATE_FILE = ".kvproxy-state.json"
LOCK_FILE = ".kvproxy.lock"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so a reader sees the old file or the new one, never half of one.

    No fsync: it cost milliseconds on every request, and these files are
    bookkeeping that readers already tolerate losing (a missing sidecar only
    means the slot file is not restored).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        return read_json(self.sidecar_path(stem))

    def update_sidecar(self, stem: str, defaults: dict, count: str | None = None,
                       **changes: Any) -> dict:
        """Merge ``changes`` into the sidecar, creating it from ``defaults`` if absent;
        ``count`` names a counter to add one to, in the same read and write."""
        sidecar = self.read_sidecar(stem) or {"format": SIDECAR_FORMAT, "stem": stem,
                                              "created_at": now_iso(), "hits": 0, **defaults}
        sidecar.update(changes)
        if count:
            sidecar[count] = int(sidecar.get(count) or 0) + 1
        write_json_atomic(self.sidecar_path(stem), sidecar)
        return sidecar

    def sidecars(self) -> list[dict]:
        """Every sidecar in the folder, with the real size of its slot file."""
        found = []
        for path in sorted(self.root.glob("*.json")):
            sidecar = read_json(path)
            if sidecar and sidecar.get("format") == SIDECAR_FORMAT:
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

    def evict(self, max_bytes: int, keep: set[str]) -> list[tuple[str, int]]:
        """Delete least recently used slot files until the folder fits ``max_bytes``.

        Files in ``keep`` (the one the slot holds, the one just written) stay.
        Returns the ``(stem, bytes)`` of what was deleted.
        """
        entries = []
        for sidecar in self.sidecars():
            used = sidecar.get("last_used_at") or sidecar.get("saved_at") or ""
            entries.append((used, sidecar["stem"], sidecar["file_bytes"]))
        total = sum(size for _, _, size in entries)
        evicted = []
        for _, stem, size in sorted(entries):
            if total <= max_bytes:
                break
            if stem in keep or not size:
                continue
            self.delete(stem)
            total -= size
            evicted.append((stem, size))
        return evicted

    # -- proxy state -------------------------------------------------------
    def read_state(self) -> dict:
        return read_json(self.root / STATE_FILE) or {}

    def write_state(self, state: dict) -> None:
        write_json_atomic(self.root / STATE_FILE, state)
