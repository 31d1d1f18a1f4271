"""One sweep of the bucket: chunks no session object names, older than the grace period,
deleted; and, over the size budget, the least recently saved conversations evicted. Run only
by the lease's holder (``sweeper``); what goes is decided by ``sweep_plan``.

One listing of every user prefix: S3 lists in key order, so each user's chunks are listed
before their session objects, and a chunk named by any session object written before those
are listed is seen named. Before deleting, each user prefix with chunks to delete or
conversations to evict has its session objects listed again and those new or rewritten since
read too: a chunk that a session written meanwhile names stays, and a conversation saved
meanwhile is not evicted. A listing or a session object that cannot be read stops the sweep
before it deletes anything: it cannot tell what is named.

The budget's session objects go before their chunks, so no session object ever names a chunk
the sweep deleted; each is looked at (HEAD) just before: one rewritten since is kept, with
every chunk it names. Deletions stop when the lease has less than ``MARGIN`` seconds left, or
at the first that fails (what was deleted until then is counted).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kvproxy.errors import StoreError
from kvproxy.storage.chunks import manifest
from kvproxy.storage.shared import session_object
from kvproxy.storage.shared.bucket import Bucket, Listed
from kvproxy.storage.shared.sweep_plan import Eviction, StoredSession, doomed, evict

MARGIN = 30.0   # seconds of lease kept in hand when deleting
LEASE_LOW = "the lease ran low: the rest waits for the next sweep"


@dataclass(frozen=True)
class Swept:
    checked: int          # chunks listed
    deleted: int          # chunks deleted, by either rule
    freed: int            # bytes deleted: those chunks, and the session objects evicted
    seconds: float
    deleted_keys: tuple[str, ...] = ()   # every chunk deleted (its uploader forgets them)
    problem: str | None = None   # why it stopped before deleting everything it chose
    evicted: int = 0          # session objects the size budget deleted
    evicted_chunks: int = 0   # of ``deleted``, the chunks only those named
    evicted_bytes: int = 0    # of ``freed``, what the budget freed
    stored: int = 0           # bytes of chunks and session objects when listed
    budget: int = 0           # the size budget in bytes (0: none)

    def summary(self) -> str:
        """The sweep's log line, after ``swept the shared store: ``."""
        text = (f"{self.checked} chunk(s) checked, {self.deleted} deleted, {self.freed} bytes "
                f"freed in {self.seconds:.2f} s")
        if self.budget:
            text += (f"; budget {self.budget} bytes, {self.stored} stored: "
                     + (f"{self.evicted} conversation(s) evicted with {self.evicted_chunks} "
                        f"chunk(s), {self.evicted_bytes} bytes" if self.evicted
                        else "nothing evicted"))
        return text + (f" (stopped: {self.problem})" if self.problem else "")


def read_sessions(bucket: Bucket, sessions: list[Listed]) -> list[StoredSession]:
    """Each listed session object with the chunk object names its manifest names and when
    its save was made (``StoreError`` when one cannot be read; one deleted meanwhile is left
    out)."""
    where, read = bucket.location, []
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
        saved = stored.generation / 1000 if stored.generation > 0 else listed.modified
        read.append(StoredSession(listed.key, listed.size, saved,
                                  frozenset(where.chunk(user, key) for key in keys.keys)))
    return read


def named_by(bucket: Bucket, sessions: list[Listed]) -> set[str]:
    """The chunk object names these session objects name (``StoreError`` when one cannot be
    read; one deleted meanwhile names nothing)."""
    return {name for stored in read_sessions(bucket, sessions) for name in stored.names}


def sweep(bucket: Bucket, grace: float, lease_left: Callable[[], float],
          clock: Callable[[], float] = time.time, budget: int = 0) -> Swept:
    """Delete the chunks of ``bucket`` that no session object names, older than ``grace``
    seconds, and over ``budget`` bytes (0: none) the least recently saved conversations,
    while ``lease_left()`` allows."""
    started = time.monotonic()
    where = bucket.location

    def of_kind(items: list[Listed], kind: str) -> list[Listed]:
        return [item for item in items if (where.kind_of(item.key) or ("", ""))[1] == kind]

    def user(key: str) -> str:
        return where.kind_of(key)[0]

    listed = bucket.listing(where.users())   # per user, chunks come before sessions
    chunks, listed_sessions = of_kind(listed, "chunks"), of_kind(listed, "sessions")
    sessions = read_sessions(bucket, listed_sessions)
    named = {name for session in sessions for name in session.names}
    unnamed = doomed(chunks, named, clock(), grace)
    plan = evict(chunks, sessions, budget, going={item.key for item in unnamed})

    # The second look: sessions written since the listing keep what they name, and are not
    # evicted (nor, this time, any conversation the first plan kept).
    seen = {(item.key, item.etag) for item in listed_sessions}
    etags = {item.key: item.etag for item in listed_sessions}
    fresh: list[StoredSession] = []
    for prefix in sorted({user(item.key) for item in unnamed} | set(map(user, plan.sessions))):
        again = [item for item in of_kind(bucket.listing(where.sessions(prefix)), "sessions")
                 if (item.key, item.etag) not in seen]
        etags.update((item.key, item.etag) for item in again)
        fresh += read_sessions(bucket, again)
    if fresh:
        named |= {name for session in fresh for name in session.names}
        unnamed = doomed(unnamed, named, clock(), grace)
        written = {session.key for session in fresh}
        sessions = [s for s in sessions if s.key not in written] + fresh
        plan = evict(chunks, sessions, budget, going={item.key for item in unnamed},
                     keep={s.key for s in sessions} - (set(plan.sessions) - written))

    evicted, kept_names, problem = evict_sessions(bucket, plan.sessions, etags, lease_left)
    # Chunks only once no session object names them: a stop before leaves them unnamed, for
    # the grace rule of a later sweep.
    budget_chunks = [name for name in plan.chunks if name not in kept_names]
    deleted: list[str] = []
    if problem is None:
        deleted, problem = delete_all(
            bucket, budget_chunks + [item.key for item in unnamed if item.key not in kept_names],
            lease_left)
    sizes = {item.key: item.size for item in listed}
    evicted_chunks = deleted[:len(budget_chunks)]   # the budget's come first
    return Swept(len(chunks), len(deleted), sum(sizes[key] for key in evicted + deleted),
                 time.monotonic() - started, tuple(deleted), problem, len(evicted),
                 len(evicted_chunks), sum(sizes[key] for key in evicted + evicted_chunks),
                 sum(item.size for item in chunks + listed_sessions), max(budget, 0))


def evict_sessions(bucket: Bucket, keys, etags: dict[str, str],
                   lease_left: Callable[[], float]) -> tuple[list[str], set[str], str | None]:
    """Delete the session objects ``keys``, each only when it is still the one listed (its
    ETag in ``etags``): one saved again since is kept. Returns those deleted, the chunk
    names the kept ones name (which must stay), and why it stopped early, if it did."""
    evicted, kept_names = [], set()
    for key in keys:
        if lease_left() < MARGIN:
            return evicted, kept_names, LEASE_LOW
        try:
            head = bucket.head(key)
            if head is None:   # deleted meanwhile (through the admin API): gone anyway
                continue
            if head.etag != etags[key]:
                kept_names |= named_by(bucket, [Listed(key, head.size, head.etag, 0.0)])
                continue
            bucket.delete(key)
        except StoreError as exc:
            return evicted, kept_names, str(exc)
        evicted.append(key)
    return evicted, kept_names, None


def delete_all(bucket: Bucket, keys: list[str], lease_left: Callable[[], float]
               ) -> tuple[list[str], str | None]:
    """Delete ``keys`` in order while the lease allows: those deleted, and why it stopped
    early, if it did."""
    deleted = []
    for key in keys:
        if lease_left() < MARGIN:
            return deleted, LEASE_LOW
        try:
            bucket.delete(key)
        except StoreError as exc:
            return deleted, str(exc)
        deleted.append(key)
    return deleted, None
