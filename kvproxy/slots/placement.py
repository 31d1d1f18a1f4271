"""Where a request runs when llama-server has several slots: one pure decision.

Given what each slot holds (the state table), which slots are busy and the
request's session, ``place`` answers with a slot and what must happen there
first, or with "wait". The order, cheapest first:

1. the slot that already holds the session (busy: wait for that slot, so a
   session never runs in two slots at once);
2. an idle slot that holds nothing kvproxy must keep (empty, a side request,
   ``default``), lowest id first;
3. the least recently used idle slot, whose session is saved first (when a background
   save holds that slot, wait for it: its session is then on disk);
4. wait for the first slot to free.

A slot just used by a conversation is kept for its next turn a few seconds
(``kept_for``): a new conversation, whose whole prefill would put that chat
behind it, does not take it meanwhile (``honours_keeps``); a returning one or a
side request may.

``queue_order`` applies it to the requests waiting in one process, first come
first served: each takes its slot out of the idle set before the next looks.
No I/O here; ``slots.pool`` takes the slot, and ``plan.plan_swap`` decides what is
saved there first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from kvproxy.slots.state import SlotState

HOLDER, FREE, EVICT, WAIT = "holder", "free", "evict", "wait"


@dataclass(frozen=True)
class SlotFacts:
    """One slot as the placement sees it."""

    id: int
    key: str | None = None        # the session key the table says the slot holds
    persistent: bool = False      # that session has a file worth saving
    used_at: str = ""             # ISO time of its last use: least recently used goes first
    busy: bool = False            # a request (of any process) holds the slot now
    kept_for: str | None = None   # kept a few seconds for this session's next turn
    saving: bool = False          # busy with a background save: idle and saved in a moment


@dataclass(frozen=True)
class Placement:
    action: str                   # HOLDER, FREE, EVICT or WAIT: why this slot (logged)
    slot: int | None = None       # where to run (None: wait)


def facts_from_table(table: Mapping[int, SlotState], slot_ids: Iterable[int],
                     busy: Iterable[int], used_here: Mapping[int, str] | None = None,
                     kept: Mapping[int, str] | None = None,
                     saving: Iterable[int] = ()) -> list[SlotFacts]:
    """The placement's view of the state table (typed slot states) and the busy slots.
    ``used_here``: this process's own last use of each slot, which the table may not show
    yet (it is written at most once a second when nothing else changed); the later wins.
    ``kept``: slot -> the session key it is kept for (a table that names another session
    there now, as another process swapped it, ends the keep). ``saving``: busy slots held by
    a background save of this process."""
    busy, saving = set(busy), set(saving)
    used_here = used_here or {}
    kept = kept or {}
    facts = []
    for slot in slot_ids:
        state = table.get(slot) or SlotState()
        key = state.key if state.session_id else None
        used_at = max(state.used_at or state.updated_at or "", used_here.get(slot, ""))
        kept_for = kept.get(slot) if key in (None, kept.get(slot)) else None
        facts.append(SlotFacts(slot, key, state.persistent and key is not None,
                               used_at, slot in busy, kept_for, slot in saving))
    return facts


def place(slots: list[SlotFacts], key: str | None, side: bool = False,
          honours_keeps: bool = False) -> Placement:
    """Decide where a request for session ``key`` runs (``side``: never saved, holds nothing;
    ``honours_keeps``: a new conversation, which leaves slots kept for others alone)."""
    if not side and key is not None:
        holder = next((s for s in slots if s.key == key or s.kept_for == key), None)
        if holder is not None:
            return Placement(WAIT) if holder.busy else Placement(HOLDER, holder.id)
    idle = [s for s in slots if (not s.busy or s.saving) and not (honours_keeps and s.kept_for)]
    free = [s for s in idle if not s.persistent and not s.busy]
    if free:
        return Placement(FREE, min(free, key=lambda s: s.id).id)
    if idle:
        victim = min(idle, key=lambda s: (s.used_at, s.id))
        if victim.busy:  # its session is being saved behind: evicting it then costs nothing,
            return Placement(WAIT)  # where another slot's session would be saved first
        return Placement(EVICT, victim.id)  # plan.plan_swap saves its session first
    return Placement(WAIT)


def queue_order(slots: list[SlotFacts], waiting: list[tuple[str | None, bool, bool]],
                mine: int) -> Placement:
    """The placement of waiter number ``mine`` when earlier waiters (``(key, side,
    honours_keeps)`` in arrival order) go first: each slot an earlier waiter would take
    counts as busy for the later ones."""
    view = list(slots)
    for index, (key, side, honours_keeps) in enumerate(waiting[:mine + 1]):
        decision = place(view, key, side, honours_keeps)
        if index == mine:
            return decision
        if decision.slot is not None:
            view = [SlotFacts(s.id, s.key, s.persistent, s.used_at, True) if s.id == decision.slot
                    else s for s in view]
    return Placement(WAIT)
