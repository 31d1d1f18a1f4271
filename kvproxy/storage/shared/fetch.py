"""Fetch on miss: a session the slot folder lacks, brought from the shared store before its
swap, so the swap restores it as if it had been saved here.

Only under the stem's own user prefix (``location.user_of``: the owner tag the caller's key
gives the stem), so a caller can fetch nothing of another user's. The session object first,
then the chunks it names that the folder lacks, several at once (``WORKERS``), written as they
arrive under the folder's chunk lock (so no freeing deletes them before the manifest names
them), then the sidecar and last the manifest, which makes the session visible. A fetch that
fails or outlasts its ``deadline`` leaves nothing behind but chunks (freed later if unnamed);
the caller then computes the prompt.

Before it downloads, a fetch is weighed against computing the prompt (``fetch_or_compute``,
on this node's recent prefill and download speeds): it is not made when it would take
longer, and it may take no longer than computing would (nor ``KVPROXY_STORE_FETCH_SECONDS``).
"""
from __future__ import annotations

import concurrent.futures
import os
import secrets
import time
from dataclasses import dataclass
from typing import Callable

from kvproxy.errors import StoreError
from kvproxy.storage.chunks import manifest
from kvproxy.storage.shared import session_object
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import user_of

WORKERS = 4
FOUND, MISSING, SLOWER = "fetched", "not in the store", "slower than computing"
LEAST_DEADLINE = 2.0   # seconds any fetch may take, however short the prompt


@dataclass(frozen=True)
class Race:
    """Fetch or compute: whether to fetch, within how many seconds in all, and else why."""

    fetch: bool
    deadline: float
    why: str = ""


def fetch_or_compute(tokens: int, fetch_bytes: int, compute_s: float | None,
                     fetch_s: float | None, limit: float) -> Race:
    """Fetch ``fetch_bytes`` for a prompt of ``tokens`` unless that would take longer than
    computing it (``fetch_s`` against ``compute_s``, this node's estimates). While either
    estimate is unknown (a node's first prefill or fetch), fetch within ``limit``; else
    within the time computing would take, at least ``LEAST_DEADLINE``."""
    if compute_s is not None and fetch_s is not None and fetch_s > compute_s:
        return Race(False, 0.0, f"fetching {fetch_bytes} bytes would take about {fetch_s:.1f} "
                                f"s, computing its {tokens} tokens about {compute_s:.1f} s")
    if compute_s is None:
        return Race(True, limit)
    return Race(True, min(limit, max(LEAST_DEADLINE, compute_s)))


@dataclass(frozen=True)
class Fetched:
    outcome: str          # FOUND, MISSING or SLOWER (a failure raises StoreError)
    chunks: int = 0       # chunks downloaded
    bytes: int = 0        # bytes downloaded
    seconds: float = 0.0
    why: str = ""         # SLOWER: the estimates


BY_SETTING = "KVPROXY_STORE_FETCH_SECONDS"
BY_PREFILL = "computing the prompt would take"


def _left(deadline: float, bound: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise StoreError(f"the fetch took longer than {bound}")
    return left


def fetch(bucket: Bucket, files, stem: str, deadline_seconds: float = 30.0,
          race: Callable[[int, int], Race] | None = None) -> Fetched:
    """Bring ``stem``'s newest save from ``bucket`` into ``files`` (a ``ChunkedFiles``).
    ``StoreError`` when it cannot, within ``deadline_seconds`` in all. ``race(tokens,
    bytes)``: whether to fetch that many bytes for a prompt of that many tokens, and within
    how long (``SLOWER`` when not)."""
    started = time.monotonic()
    deadline, bound = started + deadline_seconds, BY_SETTING
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
    with files.naming_chunks(timeout=_left(deadline, bound)):
        missing = [key for key in dict.fromkeys(named.keys) if not files.chunks.has(key)]
        if race is not None:
            tokens = int((stored.sidecar or {}).get("n_tokens") or 0)
            chosen = race(tokens, len(missing) * named.chunk_bytes)
            if not chosen.fetch:
                return Fetched(SLOWER, seconds=time.monotonic() - started, why=chosen.why)
            if started + chosen.deadline < deadline:
                deadline, bound = started + chosen.deadline, BY_PREFILL
        with concurrent.futures.ThreadPoolExecutor(WORKERS, "kvproxy-store-fetch") as pool:
            pending = {pool.submit(bucket.get, where.chunk(user, key)): key for key in missing}
            try:
                for done in concurrent.futures.as_completed(pending,
                                                            timeout=_left(deadline, bound)):
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
                raise StoreError(f"the fetch took longer than {bound}") from None
            finally:
                for future in pending:
                    future.cancel()
        _left(deadline, bound)
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
