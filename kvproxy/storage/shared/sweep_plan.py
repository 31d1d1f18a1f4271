"""What a sweep deletes from the bucket. Pure.

Two rules, over one listing:

- ``doomed``: a chunk goes only when no session object of its user prefix names it and it was
  last written more than ``grace`` seconds ago: an upload writes its chunks before the session
  object that names them, so a chunk younger than any upload may be about to be named.
- ``evict``: the size budget (``KVPROXY_STORE_MAX_GB``). When the bucket holds more bytes than
  the budget, whole conversations go, the least recently saved first across every user, until
  what remains fits: their session objects, and the chunks no remaining session object names.
  A chunk several conversations share frees its bytes only when the last of them goes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable


def doomed(chunks: Iterable, named: set[str], now: float, grace: float) -> list:
    """The listed chunks (``bucket.Listed``: ``key``, ``modified``) to delete: those whose
    object name is not in ``named`` and whose ``modified`` is older than ``now - grace``."""
    return [chunk for chunk in chunks
            if chunk.key not in named and now - chunk.modified > grace]


@dataclass(frozen=True)
class StoredSession:
    """A session object as the budget weighs it."""

    key: str                 # its object name
    size: int                # its bytes
    saved: float             # when its save was made (seconds since the epoch): oldest go first
    names: frozenset[str]    # the chunk object names its manifest names


@dataclass(frozen=True)
class Eviction:
    """What the budget takes: session objects first, then the chunks only they named."""

    sessions: tuple[str, ...] = ()
    chunks: tuple[str, ...] = ()
    freed: int = 0           # bytes of both
    remaining: int = 0       # bytes the bucket holds afterwards (0 when nothing was weighed)


def evict(chunks: Iterable, sessions: Iterable[StoredSession], budget: int,
          going: Collection[str] = (), keep: Collection[str] = ()) -> Eviction:
    """The conversations to evict so that the listed ``chunks`` (``key``, ``size``) and
    ``sessions`` fit in ``budget`` bytes (0 or less: no budget, nothing goes).

    ``going`` names chunks the grace rule deletes anyway: they neither count nor are freed
    again. Sessions in ``keep`` are never chosen (written since the plan was first made). A
    chunk no session names stays out of the eviction: only the grace rule deletes it, since
    an upload may be about to name it. When even every candidate's eviction leaves the bucket
    over budget, every candidate goes and ``remaining`` says by how much it is still over."""
    if budget <= 0:
        return Eviction()
    sessions = list(sessions)
    sizes = {chunk.key: chunk.size for chunk in chunks if chunk.key not in going}
    total = sum(sizes.values()) + sum(session.size for session in sessions)
    if total <= budget:
        return Eviction(remaining=total)
    namers: dict[str, int] = {}
    for session in sessions:
        for name in session.names & sizes.keys():
            namers[name] = namers.get(name, 0) + 1
    gone_sessions, gone_chunks, freed = [], [], 0
    for session in sorted(sessions, key=lambda s: (s.saved, s.key)):
        if total - freed <= budget:
            break
        if session.key in keep:
            continue
        gone_sessions.append(session.key)
        freed += session.size
        for name in sorted(session.names & sizes.keys()):
            namers[name] -= 1
            if namers[name] == 0:
                gone_chunks.append(name)
                freed += sizes[name]
    return Eviction(tuple(gone_sessions), tuple(gone_chunks), freed, total - freed)
