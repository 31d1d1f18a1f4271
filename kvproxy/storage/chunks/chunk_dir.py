"""The chunks themselves: immutable files named by their key, first writer wins.

``chunks/<key[:2]>/<key>`` in the slot folder, for every model (keys carry the model). A chunk
is written under a temporary name and linked to its key, which fails when the key exists:
two saves of one prefix never overwrite each other and a reader never sees half a chunk. A
crash leaves at most a temporary file, which ``sweep`` deletes. Removing chunks is the
caller's to decide (``ChunkedFiles.free``, under the folder's chunk lock).
"""
from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from pathlib import Path
from typing import Iterable, Iterator

TEMP_MARK = ".tmp-"


class ChunkDir:
    """A folder of chunks, each a file named by its key."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def put(self, key: str, parts: Iterable) -> int:
        """Store a chunk unless its key is there already; the bytes written (0: it was)."""
        final = self.path(key)
        if final.is_file():
            return 0
        final.parent.mkdir(parents=True, exist_ok=True)
        temp = final.with_name(f"{TEMP_MARK}{key}.{secrets.token_hex(4)}")
        written = 0
        try:
            with open(temp, "wb") as handle:
                for part in parts:
                    written += handle.write(part)
            try:
                os.link(temp, final)
            except FileExistsError:
                return 0   # another save of the same prefix was first
        finally:
            temp.unlink(missing_ok=True)
        return written

    def read(self, key: str) -> bytes:
        with open(self.path(key), "rb") as handle:
            return handle.read()

    @contextlib.contextmanager
    def mapped(self, key: str) -> Iterator[mmap.mmap]:
        """The chunk mapped read-only: an assembly copies from the page cache straight into
        the file it writes, without a copy of the chunk in between."""
        with open(self.path(key), "rb") as handle:
            view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield view
        finally:
            try:
                view.close()
            except BufferError:   # a failure on its way up still holds a slice: freed with it
                pass

    def size(self, key: str) -> int | None:
        try:
            return self.path(key).stat().st_size
        except OSError:
            return None

    def keys(self) -> Iterator[tuple[str, int]]:
        """Every stored chunk's key and size."""
        try:
            folders = list(os.scandir(self.root))
        except OSError:
            return
        for folder in folders:
            if not folder.is_dir():
                continue
            try:
                entries = list(os.scandir(folder.path))
            except OSError:
                continue
            for entry in entries:
                if entry.name.startswith(TEMP_MARK):
                    continue
                try:
                    yield entry.name, entry.stat().st_size
                except OSError:
                    continue

    def remove(self, key: str) -> int:
        """Delete one chunk; the bytes freed."""
        path = self.path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            return 0
        return size

    def leftovers(self) -> list[Path]:
        """Temporary files of writes a crash interrupted."""
        return sorted(self.root.glob(f"*/{TEMP_MARK}*"))
