"""Sessions stored as shared chunks: the second ``SessionFiles``, and the default.

A save is the folder's checked save (``FolderFiles``), after which the file llama-server
wrote is cut (``cut``): the chunks not stored yet are written (``ChunkDir``), then the
manifest with the session's own tail (``manifest``), then the whole file is deleted, within
a moment of being written, so most of it never reaches the disk. A restore assembles the
file under a name of its own in the slot folder, has llama-server read it and deletes it.

Crash rule: while ``<stem>.bin`` exists it is the session's newest save (it is deleted only
after its manifest is in place), so a ``<stem>.chunked`` beside it is stale. A file this
module does not fully understand (``slot_layout.read_layout`` is None: media, a later
llama-server's format, companions) stays whole, as ``FolderFiles`` keeps it. Chunks no
manifest names are deleted under the folder's chunk lock (``free``), which a cut holds from
its first chunk to its manifest, so no save in flight, of any model, can be naming one.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import secrets
import threading
from pathlib import Path
from typing import Callable, Iterator

import filelock

from kvproxy.storage import quarantine
from kvproxy.storage.chunks import cut, manifest
from kvproxy.storage.chunks.chunk_dir import ChunkDir
from kvproxy.storage.chunks.hot import HotCopies
from kvproxy.storage.chunks.index import Prefix, PrefixIndex
from kvproxy.storage.folder import FolderFiles
from kvproxy.storage.links import materialize, point
from kvproxy.storage.store import (CHUNK_LOCK, SessionStore, StorageError,
                                   unlink_with_companions)
from kvproxy.telemetry import metrics
from kvproxy.telemetry.pace import Pace
from kvproxy.upstream import slot_layout

log = logging.getLogger("kvproxy.disk")

RESTORING_SUFFIX = ".restoring.bin"   # an assembled file llama-server is reading
CHUNK_LOCK_SECONDS = 300.0            # longest wait for another cut or freeing
DEFAULT_CHUNK_TOKENS = 256


class _Hashing:
    """A write-only file that only hashes what it is given."""

    def __init__(self):
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return len(data)


class ChunkedFiles(FolderFiles):
    """Saved sessions as manifests of shared chunks in the slot folder."""

    def __init__(self, store: SessionStore, max_bytes: int = 0, min_free: int = 0,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, shared=None,
                 hot: HotCopies | None = None):
        super().__init__(store, max_bytes, min_free)
        # The shared store (``storage.shared.store.SharedStore``), told of every packed save.
        self.shared = shared
        self.hot = hot   # whole files of recent saves and restores, in memory (``hot``)
        self.chunks = ChunkDir(store.chunk_root)
        self.chunk_tokens = chunk_tokens
        self.budget.shared = self
        self._checked_formats: set[str] = set()   # layouts whose cut was proven byte for byte
        self.index = PrefixIndex(store.root)
        # Chunks are shared by every model's switch in the folder: a cut (chunks written, then
        # the manifest naming them) and a freeing never overlap, in any thread or process.
        self._chunk_thread_lock = threading.Lock()
        self._chunk_file_lock = filelock.FileLock(str(store.root / CHUNK_LOCK),
                                                  thread_local=False)
        self._lock = threading.Lock()

    # -- save ---------------------------------------------------------------------
    def save(self, stem: str, write: Callable[[str], dict],
             describe: Callable[[dict, int], dict],
             as_recorded: Callable[[object], bool] = lambda n_saved: True) -> dict | None:
        """The checked save, then the cut. With hot copies llama-server writes into the hot
        folder through a link, and the file it wrote stays there once cut."""
        incoming = self.hot.incoming(stem) if self.hot else None
        try:
            sidecar = super().save(stem, write if incoming is None else
                                   _through_link(self.store.root, incoming, write),
                                   describe, as_recorded)
            if sidecar is not None:
                try:
                    if self.pack(stem, sidecar.get("made_by") or {}) is not None and incoming:
                        self.hot.adopt(stem, incoming)
                        incoming = None
                except (OSError, StorageError) as exc:   # the whole file stays: nothing is lost
                    log.warning("kept %s.bin whole: storing it as chunks failed: %s", stem, exc)
        finally:
            if incoming is not None:   # a file kept whole stays in the slot folder, not in memory
                self._keep_in_folder(stem, incoming)
        return sidecar

    def _keep_in_folder(self, stem: str, incoming: Path) -> None:
        """Replace ``<stem>.bin``'s link to ``incoming`` by a copy, then delete ``incoming``;
        when the copy fails the link and its file stay (the start-up sweep tries again)."""
        try:
            with self.store.stem_lock(stem):
                materialize(self.store.bin_path(stem))
        except (OSError, StorageError) as exc:
            log.warning("%s.bin stays a link to memory: copying it into the slot folder failed: "
                        "%s", stem, exc)
            return
        incoming.unlink(missing_ok=True)

    def pack(self, stem: str, made_by: dict) -> int | None:
        """Store ``<stem>.bin`` as chunks and a manifest, then delete it; the bytes written,
        or None when the file stays whole."""
        path = self.store.bin_path(stem)
        with open(path, "rb") as handle:
            buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return self._pack(stem, made_by, path, buf)
        finally:
            try:
                buf.close()
            except BufferError:   # views of it are still held by a failure on its way up
                pass

    def _pack(self, stem: str, made_by: dict, path: Path, buf: mmap.mmap) -> int | None:
        """``pack`` over the file's map in memory."""
        layout = slot_layout.layout_of(buf)
        if layout is None or self.store.has_companions(stem):
            log.info("kept %s.bin whole: not a layout kvproxy cuts into chunks", stem)
            return None
        first = cut.seed(made_by, layout.format)
        keys = cut.chunk_keys(first, layout.tokens, self.chunk_tokens)
        if not keys:   # shorter than one chunk: nothing to share
            return None
        if not self._cut_proven(buf, layout, len(keys)):
            return None
        written = 0
        with self.naming_chunks():
            for i, key in enumerate(keys):
                if not self.chunks.has(key):
                    written += self.chunks.put(key, cut.joined(cut.chunk_parts(
                        buf, layout, i * self.chunk_tokens, (i + 1) * self.chunk_tokens)))
            stored = manifest.Manifest(self.chunk_tokens, first, tuple(keys), layout)
            with self.store.stem_lock(stem):
                written += manifest.write(self.store.chunked_path(stem), stored, cut.tail_parts(
                    buf, layout, len(keys) * self.chunk_tokens))
                # Named before the whole file goes, in one hold of the lock: no reader sees the
                # sidecar name a file that is gone (a crash between: the sweep names it again).
                self.store.update_sidecar(stem, {}, stored_as="chunks", chunks=len(keys),
                                          written_bytes=written)
                unlink_with_companions(path)
        metrics.observe_chunked_save(written, layout.size)
        if self.shared is not None:
            self.shared.saved(self, stem)
        return written

    def _cut_proven(self, buf, layout: slot_layout.Layout, n_chunks: int) -> bool:
        """Whether cutting this layout gives back the file byte for byte (checked the first
        time this process meets the layout)."""
        with self._lock:
            if layout.format in self._checked_formats:
                return True
        c = self.chunk_tokens
        pieces = [b"".join(cut.joined(cut.chunk_parts(buf, layout, i * c, (i + 1) * c)))
                  for i in range(n_chunks)]
        tail = b"".join(cut.joined(cut.tail_parts(buf, layout, n_chunks * c)))
        rebuilt = _Hashing()
        try:
            cut.assemble(layout, tail, pieces.__getitem__, n_chunks, c, rebuilt)
        except ValueError as exc:
            log.warning("not storing files of layout %s as chunks: %s", layout.format, exc)
            return False
        if rebuilt.digest.digest() != hashlib.sha256(buf).digest():
            log.warning("not storing files of layout %s as chunks: cutting one and putting it "
                        "back together did not give the same bytes", layout.format)
            return False
        with self._lock:
            self._checked_formats.add(layout.format)
        return True

    # -- restore ------------------------------------------------------------------
    @contextlib.contextmanager
    def staged(self, stem: str) -> Iterator[str]:
        """The name llama-server restores ``stem`` from: its whole file when there is one,
        else its hot copy linked in, else the file put together from its chunks (in the hot
        folder when there is one, where it then stays as the hot copy)."""
        if self.store.bin_path(stem).is_file():
            yield self.store.bin_path(stem).name
            return
        try:
            stored, tail = manifest.read(self.store.chunked_path(stem))
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot put {stem} together from its chunks: {exc}") from exc
        if self.hot is None:
            path = self.store.root / f"{stem}.{secrets.token_hex(4)}{RESTORING_SUFFIX}"
            self._assemble(stem, stored, tail, path)
            try:
                yield path.name
            finally:
                path.unlink(missing_ok=True)
            return
        with self.hot.lent(stem, stored.layout) as copy:
            if copy is not None:
                metrics.count_hot_restore(True)
                with self._linked(stem, copy) as name:
                    yield name
                return
        metrics.count_hot_restore(False)
        incoming = self.hot.incoming(stem)
        self._assemble(stem, stored, tail, incoming)
        try:
            with self._linked(stem, incoming) as name:
                yield name
        finally:
            self.hot.adopt(stem, incoming)

    def _assemble(self, stem: str, stored: manifest.Manifest, tail, path: Path) -> None:
        """Write the slot file ``stored`` maps to ``path`` (StorageError when it cannot be)."""
        try:
            with open(path, "wb") as out, contextlib.ExitStack() as maps:
                cut.assemble(stored.layout, tail,
                             lambda i: maps.enter_context(self.chunks.mapped(stored.keys[i])),
                             len(stored.keys), stored.chunk_tokens, out)
        except (OSError, ValueError) as exc:
            path.unlink(missing_ok=True)
            raise StorageError(f"cannot put {stem} together from its chunks: {exc}") from exc

    @contextlib.contextmanager
    def _linked(self, stem: str, target: Path) -> Iterator[str]:
        """A name in the slot folder for llama-server to read ``target`` by, for one restore."""
        link = self.store.root / f"{stem}.{secrets.token_hex(4)}{RESTORING_SUFFIX}"
        try:
            point(link, target)
        except OSError as exc:
            raise StorageError(f"cannot link {stem}'s whole file into the slot folder: "
                               f"{exc}") from exc
        try:
            yield link.name
        finally:
            link.unlink(missing_ok=True)

    def fetch(self, stem: str, prefill: Pace | None = None) -> bool:
        """Fetch on miss: bring ``stem`` from the shared store when the folder lacks it;
        whether it is here now (False: no shared store, not there, the fetch failed, or it
        would be slower than computing the prompt at ``prefill``'s pace, a ``Pace``)."""
        if self.shared is None or self.has(stem):
            return False
        return self.shared.fetch(self, stem, prefill)

    def check(self, stem: str) -> tuple[dict | None, str | None]:
        if self.store.bin_path(stem).is_file():
            return super().check(stem)
        with self.store.stem_lock(stem):
            sidecar = self.store.read_sidecar(stem)
            if not (sidecar and sidecar.get("saved_at")):
                return sidecar, None
            return sidecar, self.problem_of(stem, sidecar)

    def set_aside(self, stem: str, reason: str) -> str:
        if self.hot is not None:
            self.hot.forget(stem)
        return quarantine.set_aside(self.store, stem, reason, lambda store, stem: self.check(stem))

    def problem_of(self, stem: str, sidecar: dict) -> str | None:
        """Why ``<stem>.chunked`` cannot give back the file its sidecar describes."""
        try:
            stored, _ = manifest.read(self.store.chunked_path(stem))
        except FileNotFoundError:
            return "its file is gone"
        except (OSError, ValueError) as exc:
            return f"its manifest cannot be read: {exc}"
        tail = stored.layout.size - len(stored.keys) * stored.chunk_bytes
        try:
            if manifest.tail_bytes(self.store.chunked_path(stem)) != tail:
                return f"its tail is not the {tail} bytes its manifest needs"
        except (OSError, ValueError) as exc:
            return f"its manifest cannot be read: {exc}"
        if stored.layout.size != sidecar.get("saved_bytes"):
            return f"its manifest makes {stored.layout.size} bytes, its sidecar says " \
                   f"{sidecar.get('saved_bytes')}"
        for key in stored.keys:
            size = self.chunks.size(key)
            if size != stored.chunk_bytes:
                return f"its chunk {key[:12]} is missing" if size is None else \
                    f"its chunk {key[:12]} has {size} bytes, not {stored.chunk_bytes}"
        return None

    def tokens(self, stem: str) -> list[int] | None:
        """The tokens of the session saved as ``stem``, however it is stored."""
        return self.store.saved_tokens(stem)

    def longest_prefix(self, tokens: Callable[[], list[int]], accept: Callable[[str], bool]) -> Prefix | None:
        return self.index.longest(tokens, accept)

    # -- delete and free -------------------------------------------------------------
    def delete(self, stem: str) -> bool:
        """Delete a session (the admin API; eviction deletes through the budget and keeps the
        shared store's copy): here, and in the shared store."""
        removed = super().delete(stem)
        if self.hot is not None:
            self.hot.forget(stem)
        if removed:
            self.free()
            if self.shared is not None:
                self.shared.deleted(self, stem)
        return removed

    def usage(self) -> tuple[int, dict[str, int]]:
        """All chunk bytes, and per stem the bytes of the chunks only it names (what deleting
        it frees)."""
        names: dict[str, int] = {}
        owner: dict[str, str] = {}
        for stem, keys in self.named().items():
            for key in set(keys):
                names[key] = names.get(key, 0) + 1
                owner[key] = stem
        total, own = 0, {}
        for key, size in self.chunks.keys():
            total += size
            if names.get(key) == 1:
                own[owner[key]] = own.get(owner[key], 0) + size
        return total, own

    def named(self) -> dict[str, tuple[str, ...]]:
        """Every manifest's chunk keys, by stem (unreadable manifests name none)."""
        found = {}
        for path in self.store.root.glob(f"*{manifest.SUFFIX}"):
            try:
                found[path.name[:-len(manifest.SUFFIX)]] = manifest.read_keys(path)
            except (OSError, ValueError):
                continue
        return found

    @contextlib.contextmanager
    def naming_chunks(self, timeout: float = CHUNK_LOCK_SECONDS) -> Iterator[None]:
        """Hold the folder's chunk lock (``StorageError`` after ``timeout`` seconds)."""
        if not self._chunk_thread_lock.acquire(timeout=timeout):
            raise StorageError(f"the chunk lock stayed taken for {timeout:.0f} s")
        try:
            try:
                self._chunk_file_lock.acquire(timeout=timeout)
            except filelock.Timeout:
                raise StorageError(f"another process held the chunk lock for {timeout:.0f} s") \
                    from None
            try:
                yield
            finally:
                self._chunk_file_lock.release()
        finally:
            self._chunk_thread_lock.release()

    def free(self) -> int:
        """Delete the chunks no manifest names; the bytes freed (0 when the chunk lock
        cannot be had: the next freeing does it)."""
        try:
            with self.naming_chunks():
                named = {key for keys in self.named().values() for key in keys}
                freed = 0
                for key, _ in list(self.chunks.keys()):
                    if key not in named:
                        freed += self.chunks.remove(key)
                return freed
        except StorageError as exc:
            log.warning("did not free unused chunks: %s", exc)
            return 0

    def sweep(self) -> list[str]:
        done = super().sweep()
        for path in self.chunks.leftovers():
            path.unlink(missing_ok=True)
            done.append(f"deleted leftover temporary chunk {path.name}")
        for path in sorted(self.store.root.glob(f"*{RESTORING_SUFFIX}")):
            path.unlink(missing_ok=True)
            done.append(f"deleted leftover assembled file {path.name}")
        if self.hot is not None:
            done += self.hot.sweep()
        freed = self.free()
        if freed:
            done.append(f"deleted chunks no manifest names ({freed} bytes)")
        return done


def _through_link(root: Path, target: Path, write: Callable[[str], dict]) -> Callable[[str], dict]:
    """``write`` (llama-server's save under a name in ``root``) made to land in ``target``:
    a link by that name points there, and llama-server writes through it."""
    def write_into(name: str) -> dict:
        point(root / name, target)
        return write(name)
    return write_into
