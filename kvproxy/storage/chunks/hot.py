"""Hot copies: whole slot files of recent saves and restores, kept in memory (a tmpfs folder).

llama-server reads only whole files, so a restore from chunks first writes the whole file
(two copies of every byte against one for a whole file on disk). A hot copy makes the restore
of a conversation saved or restored recently as fast as a whole file, without a byte of it
on the disk: llama-server saves straight into the hot folder through a symbolic link put
where it writes (``receiving``), kvproxy cuts the chunks from that file, and the file stays
as the hot copy; a restore links the copy where llama-server reads (``lent``).

The folder is a cache. Its files are named ``<stem>.<hex>.bin``, never rewritten, and used
only when their map (``slot_layout``) is the one the session's manifest names, so a stale or
foreign file is never restored. The least recently used are deleted past ``max_bytes``;
copies lent to a restore are not deleted until it ends. Nothing here needs to survive a
reboot: the chunks and manifests are the sessions.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
from pathlib import Path
from typing import Iterator

from kvproxy.telemetry import metrics
from kvproxy.upstream import slot_layout

log = logging.getLogger("kvproxy.disk")

SUFFIX = ".bin"
ID_BYTES = 6
INCOMING = ".incoming"   # <stem>.<hex>.incoming.bin: a save or assembly not adopted yet


class HotCopies:
    """The hot folder: at most ``max_bytes`` of whole slot files, least recently used out first."""

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lent: dict[Path, int] = {}
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    # -- files coming in ----------------------------------------------------------------
    def incoming(self, stem: str) -> Path:
        """A new name in the hot folder for a file being written for ``stem``."""
        return self.root / f"{stem}.{secrets.token_hex(ID_BYTES)}{INCOMING}{SUFFIX}"

    def adopt(self, stem: str, path: Path) -> None:
        """Keep ``path`` (written for ``stem``, complete) as ``stem``'s hot copy: older copies
        of ``stem`` go, then the least recently used of others past the budget."""
        final = self.root / path.name.replace(INCOMING, "")
        try:
            size = path.stat().st_size
            if size > self.max_bytes:
                path.unlink(missing_ok=True)
                return
            os.replace(path, final)
        except OSError as exc:
            log.warning("did not keep a hot copy of %s: %s", stem, exc)
            path.unlink(missing_ok=True)
            return
        with self._lock:
            for old in self._copies_of(stem):
                if old != final:
                    self._remove(old)
            metrics.HOT_BYTES.set(self._trim())

    # -- files going out ----------------------------------------------------------------
    @contextlib.contextmanager
    def lent(self, stem: str, layout: slot_layout.Layout) -> Iterator[Path | None]:
        """``stem``'s newest copy whose map is ``layout`` (None: there is none), kept from
        deletion until the block ends and marked as just used."""
        with self._lock:
            found = next((path for path in self._copies_of(stem) if _maps_to(path, layout)),
                         None)
            if found is not None:
                self._lent[found] = self._lent.get(found, 0) + 1
        if found is None:
            yield None
            return
        try:
            with contextlib.suppress(OSError):
                os.utime(found)
            yield found
        finally:
            with self._lock:
                self._lent[found] -= 1
                if not self._lent[found]:
                    del self._lent[found]

    def forget(self, stem: str) -> None:
        """Delete ``stem``'s copies (the session is deleted, set aside or evicted)."""
        with self._lock:
            for path in self._copies_of(stem):
                self._remove(path)

    def sweep(self) -> list[str]:
        """Delete what an interrupted save or assembly left (at start-up, nothing is incoming)."""
        done = []
        for path in sorted(p for p in self._names() if p.name.endswith(INCOMING + SUFFIX)):
            path.unlink(missing_ok=True)
            done.append(f"deleted unfinished hot copy {path.name}")
        return done

    def held_bytes(self) -> int:
        return sum(size for _, size, _ in self._listing())

    # -- inside -----------------------------------------------------------------------
    def _copies_of(self, stem: str) -> list[Path]:
        """``stem``'s adopted copies, newest first."""
        found = []
        for path in self._names():
            name = path.name
            if not (name.startswith(stem + ".") and _is_id(name[len(stem) + 1:-len(SUFFIX)])):
                continue   # another stem's, or incoming
            with contextlib.suppress(OSError):
                found.append((path.stat().st_mtime, path))
        return [path for _, path in sorted(found, reverse=True)]

    def _listing(self) -> list[tuple[Path, int, float]]:
        listing = []
        for path in self._names():
            if path.name.endswith(INCOMING + SUFFIX):
                continue
            with contextlib.suppress(OSError):
                stat = path.stat()
                listing.append((path, stat.st_size, stat.st_mtime))
        return listing

    def _names(self) -> list[Path]:
        try:
            return [self.root / name for name in os.listdir(self.root) if name.endswith(SUFFIX)]
        except OSError:
            return []

    def _trim(self) -> int:
        """Delete the least recently used copies, not lent, until the folder fits its budget;
        the bytes left."""
        listing = sorted(self._listing(), key=lambda item: item[2])
        total = sum(size for _, size, _ in listing)
        for path, size, _ in listing:
            if total <= self.max_bytes:
                break
            if self._remove(path):
                total -= size
        return total

    def _remove(self, path: Path) -> bool:
        if path in self._lent:
            return False
        path.unlink(missing_ok=True)
        return True


def _is_id(text: str) -> bool:
    return len(text) == 2 * ID_BYTES and all(c in "0123456789abcdef" for c in text)


def _maps_to(path: Path, layout: slot_layout.Layout) -> bool:
    """Whether the file at ``path`` is the slot file ``layout`` maps (size, tokens, rows)."""
    try:
        if path.stat().st_size != layout.size:
            return False
        with open(path, "rb") as handle:
            buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return slot_layout.layout_of(buf) == layout
        finally:
            buf.close()
    except (OSError, ValueError):
        return False

