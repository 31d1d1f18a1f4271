"""Which llama-server process kvproxy talks to: a restart is seen in ``GET /slots``.

What kvproxy learns of llama-server (its slot count, fingerprint, KV format, slot sizes)
holds only for the process it was learned from; a model swapper, a crash-restart or an
operator may start another one, with fewer slots, another model or other cache types,
behind the same address while kvproxy runs. ``/slots`` tells: its length is the slot count,
each entry has the slot's ``n_ctx``, and ``id_task`` (the last task a slot ran) only grows
within one process (task ids count up from 0 at start; a slot keeps its last task's id).
So a listing with another count or size, or whose highest task id is lower than one seen
before, comes from a new process. Pure functions: the switch asks and acts.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Listing:
    """What a ``/slots`` listing says about the process that answered it."""

    n_ctx: tuple[int, ...]    # each slot's context, in slot order
    last_task: int = -1       # the highest task id any slot shows (-1: none ran a task)


def of_listing(listing: object) -> Listing | None:
    """The listing's facts; None for an answer that is not a list of slots."""
    if not isinstance(listing, list) or not listing:
        return None
    entries = sorted((e for e in listing if isinstance(e, dict) and isinstance(e.get("id"), int)),
                     key=lambda e: e["id"])
    if not entries:
        return None
    tasks = [e["id_task"] for e in entries if isinstance(e.get("id_task"), int)]
    return Listing(tuple(int(e.get("n_ctx") or 0) for e in entries), max(tasks, default=-1))


def restarted(before: Listing | None, now: Listing | None) -> str | None:
    """Why ``now`` comes from another llama-server process than ``before``, or None (the
    same process, or nothing to compare)."""
    if before is None or now is None:
        return None
    if len(now.n_ctx) != len(before.n_ctx):
        return f"it has {len(now.n_ctx)} slot(s), it had {len(before.n_ctx)}"
    if now.n_ctx != before.n_ctx:
        return f"its slots hold {list(now.n_ctx)} tokens, they held {list(before.n_ctx)}"
    if now.last_task < before.last_task:
        return f"its task ids started again (last {now.last_task}, it was {before.last_task})"
    return None


def driven_slots(configured: int, slot_id: int, total: int | None) -> list[int] | None:
    """The slots kvproxy drives: ``KVPROXY_SLOTS`` (1: the slot ``KVPROXY_SLOT_ID``), at most
    as many as llama-server has (a slot id past its count wraps onto another slot, and two
    sessions would share it); 0: as many as it has. None while that count is unknown."""
    if configured == 1:
        return [slot_id]
    if total is None:
        return list(range(configured)) if configured > 1 else None
    count = min(configured, total) if configured > 1 else total
    return [slot_id] if count == 1 and configured == 0 else list(range(count))
