"""One sweep of the bucket: chunks no session object names, older than the grace period,
deleted. Run only by the lease's holder (``sweeper``).

One listing of every user prefix: S3 lists in key order, so each user's chunks are listed
before their session objects, and a chunk named by any session object written before those
are listed is seen named. Before deleting, each user prefix with chunks to
delete has its session objects listed again and those new or rewritten since read too, which
keeps a chunk that a session written meanwhile names. A listing or a session object that
cannot be read stops the sweep before it deletes anything: it cannot tell what is named.
Deletions stop when the lease has less than ``MARGIN`` seconds left, or at the first that
fails (what was deleted until then is counted).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kvproxy.errors import StoreError
from kvproxy.storage.chunks import manifest
from kvproxy.storage.shared import session_object
from kvproxy.storage.shared.bucket import Bucket, Listed
from kvproxy.storage.shared.sweep_plan import doomed

MARGIN = 30.0   # seconds of lease kept in hand when deleting


@dataclass(frozen=True)
class Swept:
    checked: int          # chunks listed
    deleted: int          # chunks deleted
    freed: int            # their bytes
    seconds: float
    deleted_keys: tuple[str, ...] = ()
    problem: str | None = None   # why it stopped before deleting every chunk it chose


def named_by(bucket: Bucket, sessions: list[Listed]) -> set[str]:
    """The chunk object names these session objects name (``StoreError`` when one cannot be
    read; one deleted meanwhile names nothing)."""
    where, named = bucket.location, set()
    for listed in sessions:
        found = bucket.get(listed.key)
        if found is None:
            continue
        try:
            stored = session_object.decode(found[0])
            keys, _ = manifest.parse(stored.manifest)
        except ValueError as exc:
            raise StoreError(f"cannot read the session object {listed.key} ({exc}): not "
                             "sweeping") from None
        user, _ = where.kind_of(listed.key)
        named.update(where.chunk(user, key) for key in keys.keys)
    return named


def sweep(bucket: Bucket, grace: float, lease_left: Callable[[], float],
          clock: Callable[[], float] = time.time) -> Swept:
    """Delete the chunks of ``bucket`` that no session object names, older than ``grace``
    seconds, while ``lease_left()`` allows."""
    started = time.monotonic()
    where = bucket.location
    listed = bucket.listing(where.users())   # per user, chunks come before sessions
    chunks = [item for item in listed if (where.kind_of(item.key) or ("", ""))[1] == "chunks"]
    sessions = [item for item in listed
                if (where.kind_of(item.key) or ("", ""))[1] == "sessions"]
    named = named_by(bucket, sessions)
    doomed_now = doomed(chunks, named, clock(), grace)
    seen = {(item.key, item.etag) for item in sessions}
    for user in sorted({where.kind_of(item.key)[0] for item in doomed_now}):
        again = [item for item in bucket.listing(where.sessions(user))
                 if (item.key, item.etag) not in seen
                 and (where.kind_of(item.key) or ("", ""))[1] == "sessions"]
        named |= named_by(bucket, again)
    doomed_now = doomed(doomed_now, named, clock(), grace)
    deleted, freed, problem = [], 0, None
    for item in doomed_now:
        if lease_left() < MARGIN:
            problem = "the lease ran low: the rest waits for the next sweep"
            break
        try:
            bucket.delete(item.key)
        except StoreError as exc:
            problem = str(exc)
            break
        deleted.append(item.key)
        freed += item.size
    return Swept(len(chunks), len(deleted), freed, time.monotonic() - started,
                 tuple(deleted), problem)
