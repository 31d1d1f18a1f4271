"""One saved session copied from the slot folder to the shared store: its chunks first, then
the session object naming them, so the bucket never holds a manifest whose chunks are missing.

Chunks are written once (``put_if_absent``: a chunk another node wrote is left as it is); the
session object goes over the stored one only when it is newer (``session_object.replaces``),
by a conditional PUT on the ETag read just before, so two nodes writing one conversation at
once never put an older save over a newer one: the later save wins, the other is dropped.

A sweep (``sweep``) deletes chunks no session object names; an upload may be about to name
one again (the same start of a conversation, found in the bucket). So an upload reads the
sweep's lease (``lease.fence``) before it checks its chunks and again just before it writes
the session object: while a sweep holds the lease, or when one began or ended in between,
it writes nothing now (``SWEEP_UNDER_WAY``: the uploader tries again soon, and checks every
chunk afresh). A session object written after the second look is listed by any sweep that
begins meanwhile, which waits a few seconds before listing; if the lease changed while it
was written, the upload asks for its chunks to be checked again (``recheck``).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvproxy.errors import StoreError
from kvproxy.storage.chunks import manifest
from kvproxy.storage.shared import lease, session_object
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import user_of

WRITTEN, NEWER_THERE, GONE, DELETED = "written", "newer there", "gone", "deleted"
ALREADY_THERE = "already there"
SWEEP_UNDER_WAY = "waiting for a sweep"
REPLACE_TRIES = 3           # conditional writes lost to another node before giving up for now
KNOWN_CHUNKS = 65536        # chunk keys remembered as in the bucket
KNOWN_SECONDS = 300.0       # how long one is trusted to be there without looking again


class KnownChunks:
    """Chunk keys this process saw in the bucket (bounded, oldest forgotten first), so a
    conversation's next turn does not ask again for every chunk of its earlier turns. Each is
    trusted while the sweep's lease is as it was when the chunk was seen (``under``), and
    for ``seconds`` at most."""

    def __init__(self, limit: int = KNOWN_CHUNKS, seconds: float = KNOWN_SECONDS,
                 clock=time.monotonic):
        self.limit = limit
        self.seconds = seconds
        self.clock = clock
        self._keys: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._fence: lease.Fence | None = None

    def under(self, fence: lease.Fence) -> None:
        """The sweep's lease now: when it changed since the chunks were seen, a sweep may
        have deleted any of them, so every one is looked at again."""
        with self._lock:
            if fence != self._fence:
                self._keys.clear()
                self._fence = fence

    def __contains__(self, name: str) -> bool:
        with self._lock:
            seen = self._keys.get(name)
            if seen is None:
                return False
            if self.clock() - seen > self.seconds:
                del self._keys[name]
                return False
            self._keys.move_to_end(name)
            return True

    def discard(self, name: str) -> None:
        """``name`` is no longer in the bucket (a sweep deleted it)."""
        with self._lock:
            self._keys.pop(name, None)

    def add(self, name: str) -> None:
        with self._lock:
            self._keys[name] = self.clock()
            self._keys.move_to_end(name)
            while len(self._keys) > self.limit:
                self._keys.popitem(last=False)


@dataclass(frozen=True)
class Published:
    outcome: str            # WRITTEN, ALREADY_THERE, NEWER_THERE, SWEEP_UNDER_WAY, or GONE
    chunks: int = 0         # chunks this call wrote
    chunk_bytes: int = 0
    session_bytes: int = 0
    recheck: bool = False   # a sweep began while the session object was written


def snapshot(files, stem: str) -> session_object.SessionObject | None:
    """The session's packed save as one object: sidecar and ``<stem>.chunked`` read under the
    stem's lock, so both are of one save. None when there is none to copy: no manifest, or a
    whole ``<stem>.bin`` beside it (a newer save, whose own packing queues it again)."""
    store = files.store
    with store.stem_lock(stem):
        if store.bin_path(stem).is_file():
            return None
        sidecar = store.read_sidecar(stem)
        try:
            data = store.chunked_path(stem).read_bytes()
        except FileNotFoundError:
            return None
    generation = session_object.generation_of(sidecar or {})
    if generation is None:
        return None
    return session_object.SessionObject(generation, stem, sidecar, data)


def publish(bucket: Bucket, files, stem: str, known: KnownChunks | None = None,
            recheck: bool = False) -> Published:
    """Copy the packed save of ``stem`` from ``files`` (a ``ChunkedFiles``) to ``bucket``.
    ``recheck``: the same save is there already, but a sweep may have run while it was
    written: look at each chunk it names and put back any missing."""
    known = known if known is not None else KnownChunks()
    saved = snapshot(files, stem)
    if saved is None:
        return Published(GONE)
    try:
        keys = tuple(manifest.meta_of(saved.manifest).get("keys") or ())
    except ValueError:
        return Published(GONE)
    before = lease.fence(bucket, lease.SWEEP)
    if before.held:
        return Published(SWEEP_UNDER_WAY)
    known.under(before)
    user, where = user_of(stem), bucket.location
    head = bucket.head(where.session(user, stem))   # this save, or a later one, is there
    theirs = session_object.generation_in(head.metadata) if head else None
    if theirs is not None and not session_object.replaces(saved.generation, theirs):
        if theirs != saved.generation:
            return Published(NEWER_THERE)
        if not recheck:
            return Published(ALREADY_THERE)
    written = written_bytes = 0
    for key in keys:
        name = where.chunk(user, key)
        if name in known:
            continue
        if bucket.head(name) is None:
            try:
                body = files.chunks.read(key)
            except FileNotFoundError:   # freed: a newer save replaced this one, and is queued
                return Published(GONE, written, written_bytes)
            if bucket.put_if_absent(name, body):
                written += 1
                written_bytes += len(body)
        known.add(name)
    if theirs == saved.generation:   # a recheck: the session object is there already
        return Published(ALREADY_THERE, written, written_bytes)
    body = saved.encode()
    name = where.session(user, stem)
    for _ in range(REPLACE_TRIES):
        head = bucket.head(name)
        theirs = session_object.generation_in(head.metadata) if head else None
        if not session_object.replaces(saved.generation, theirs):
            return Published(NEWER_THERE, written, written_bytes)
        if lease.fence(bucket, lease.SWEEP) != before:   # a sweep began or ended meanwhile
            return Published(SWEEP_UNDER_WAY, written, written_bytes)
        if bucket.replace(name, body, head.etag if head else None, saved.metadata):
            raced = lease.fence(bucket, lease.SWEEP) != before
            return Published(WRITTEN, written, written_bytes, len(body), recheck=raced)
    raise StoreError(f"session {stem} was written by other nodes {REPLACE_TRIES} times while "
                     "this one wrote it; trying again later")


def unpublish(bucket: Bucket, stem: str) -> Published:
    """A conversation deleted on this node: its session object goes from the bucket, so no
    node fetches it again (its chunks stay until a sweep of the bucket frees them)."""
    bucket.delete(bucket.location.session(user_of(stem), stem))
    return Published(DELETED)
