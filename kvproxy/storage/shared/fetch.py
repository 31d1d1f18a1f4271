"""Fetch on miss: a session the slot folder lacks, brought from the shared store before its
swap, so the swap restores it as if it had been saved here.

Only under the stem's own user prefix (``location.user_of``: the owner tag the caller's key
gives the stem), so a caller can fetch nothing of another user's. The session object first,
then the chunks it names that the folder lacks, several at once (``WORKERS``), written as they
arrive under the folder's chunk lock (so no freeing deletes them before the manifest names
them), then the sidecar and last the manifest, which makes the session visible. A fetch that
fails or outlasts its ``deadline`` leaves nothing behind but chunks (freed later if unnamed);
the caller then computes the prompt.
"""
from __future__ import annotations

import concurrent.futures
import os
import secrets
import time
from dataclasses import dataclass

from kvproxy.errors import StoreError
from kvproxy.storage.chunks import manifest
from kvproxy.storage.shared import session_object
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import user_of

WORKERS = 4
FOUND, MISSING = "fetched", "not in the store"


@dataclass(frozen=True)
class Fetched:
    outcome: str          # FOUND or MISSING (a failure raises StoreError)
    chunks: int = 0       # chunks downloaded
    bytes: int = 0        # bytes downloaded
    seconds: float = 0.0


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise StoreError("the fetch took longer than KVPROXY_STORE_FETCH_SECONDS")
    return left


def fetch(bucket: Bucket, files, stem: str, deadline_seconds: float = 30.0) -> Fetched:
    """Bring ``stem``'s newest save from ``bucket`` into ``files`` (a ``ChunkedFiles``).
    ``StoreError`` when it cannot, within ``deadline_seconds`` in all."""
    started = time.monotonic()
    deadline = started + deadline_seconds
    user, where = user_of(stem), bucket.location
    found = bucket.get(where.session(user, stem))
    if found is None:
        return Fetched(MISSING)
    try:
        stored = session_object.decode(found[0])
        named, _ = manifest.parse(stored.manifest)
    except ValueError as exc:
        raise StoreError(f"the stored session {stem} cannot be read: {exc}") from None
    if stored.stem != stem:
        raise StoreError(f"the stored session {stem} names another session")
    chunks, size = 0, 0
    with files.naming_chunks(timeout=_left(deadline)):
        missing = [key for key in dict.fromkeys(named.keys) if not files.chunks.has(key)]
        with concurrent.futures.ThreadPoolExecutor(WORKERS, "kvproxy-store-fetch") as pool:
            pending = {pool.submit(bucket.get, where.chunk(user, key)): key for key in missing}
            try:
                for done in concurrent.futures.as_completed(pending, timeout=_left(deadline)):
                    body = done.result()
                    key = pending[done]
                    if body is None:
                        raise StoreError(f"the stored session {stem} names chunk {key[:12]}, "
                                         "which the store lacks")
                    if len(body[0]) != named.chunk_bytes:   # never let it into the folder
                        raise StoreError(f"the stored chunk {key[:12]} has {len(body[0])} bytes, "
                                         f"not {named.chunk_bytes}")
                    files.chunks.put(key, [body[0]])
                    chunks, size = chunks + 1, size + len(body[0])
            except concurrent.futures.TimeoutError:
                raise StoreError("the fetch took longer than KVPROXY_STORE_FETCH_SECONDS") \
                    from None
            finally:
                for future in pending:
                    future.cancel()
        _left(deadline)
        _put_in_place(files, stem, stored)
    problem = files.check(stem)[1]
    if problem:
        files.store.delete(stem)   # here only: the stored copy is not this node's to delete
        raise StoreError(f"the stored session {stem} does not match its chunks: {problem}")
    return Fetched(FOUND, chunks, size + len(found[0]), time.monotonic() - started)


def _put_in_place(files, stem: str, stored: session_object.SessionObject) -> None:
    """The sidecar, then the manifest (whose presence makes the session stored), under the
    stem's lock; a session saved here meanwhile is kept."""
    store = files.store
    with store.stem_lock(stem):
        if store.has_bin(stem):
            return
        # A save of a session that was itself fetched (on another node, then carried on
        # there) names the generation it was fetched at: this fetch's replaces it.
        fields = {k: v for k, v in stored.sidecar.items()
                  if k not in ("stem", "defaults", "count", "of_save")}
        store.update_sidecar(stem, {}, **{**fields, "fetched_generation": stored.generation})
        path = store.chunked_path(stem)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            temp.write_bytes(stored.manifest)
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
