"""What the saved sessions take in the slot folder, and what they stand for.

Stored bytes are what is on disk: whole slot files (with their companions), manifests and
every chunk once. Logical bytes are the slot files those stand for, as llama-server wrote
them: their ratio is what storing sessions as shared chunks saves (``/metrics``, the status
page, ``kvproxy stats``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvproxy.storage.chunks import manifest
from kvproxy.storage.store import (CHUNK_DIR, CHUNKED_SUFFIX, PROBE_PREFIX, bytes_with_companions,
                                   companion_index)


@dataclass(frozen=True)
class FolderUsage:
    stored_bytes: int = 0    # on disk: files, manifests, chunks
    logical_bytes: int = 0   # the slot files they stand for
    files: int = 0           # saved sessions and base snapshots (whole or as manifests)
    chunks: int = 0
    chunk_bytes: int = 0

    @property
    def ratio(self) -> float | None:
        """Stored over logical bytes (None: nothing stored)."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else None


def _chunk_dirs(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir() and p.name == CHUNK_DIR]
    except OSError:
        return []


def folder_usage(root: str | Path) -> FolderUsage:
    """Scan the folder; files vanishing mid-scan are skipped, and so is the start-up check's
    probe (written and deleted at once)."""
    root = Path(root)
    stored = logical = files = chunks = chunk_bytes = 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return FolderUsage()
    index = companion_index(root)
    for entry in entries:
        name = entry.name
        if name.endswith(".bin") and not name.startswith(PROBE_PREFIX):
            size = bytes_with_companions(Path(entry.path), index)   # <file>.ckpt too
            if size:
                stored, logical, files = stored + size, logical + size, files + 1
        elif name.endswith(CHUNKED_SUFFIX) and not name.startswith("."):
            try:
                stored += entry.stat().st_size
            except OSError:
                continue
            logical += manifest.file_size(Path(entry.path))
            files += 1
    for folder in _chunk_dirs(root):
        for dirpath, _, names in os.walk(folder):
            for name in names:
                try:
                    size = os.stat(os.path.join(dirpath, name)).st_size
                except OSError:
                    continue
                chunks, chunk_bytes = chunks + 1, chunk_bytes + size
    return FolderUsage(stored + chunk_bytes, logical, files, chunks, chunk_bytes)
