"""Side tasks llama-server runs in a slot of its own choosing, whatever kvproxy pinned.

llama-server reads ``id_slot`` only for completions. Embeddings, rerank and
decisions (``/v1/systemone``) never set it, and a transcription comes as a
form kvproxy cannot pin: each task goes to the least recently used idle slot,
one slot per input, and overwrites what that slot held. With one slot that is
the leased slot. With several it can be any slot that is idle in llama-server,
including one another thread of kvproxy holds between two steps (a background
save, the moment between a restore and its answer, after an answer's last token).

So a side task runs only while kvproxy holds every slot (``side_task``): it
waits, bounded, for each one, saves the sessions there that have unsaved turns,
and afterwards marks each slot the task ran in as unproven, so its session comes
back from its file. The decisions are ``plan.side_slot``,
``plan.save_before_side`` and ``plan.side_landed_in``.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Iterator

from kvproxy.sessions.identity import SIDE_SESSION, Session
from kvproxy.upstream.llama import UpstreamError, UpstreamUnavailable
from kvproxy.slots.plan import save_before_side, side_landed_in, side_slot
from kvproxy.slots.state import SlotState
from kvproxy.storage.store import StorageError

if TYPE_CHECKING:
    from kvproxy.slots.lease import Lease
    from kvproxy.slots.switch import SlotSwitch

log = logging.getLogger("kvproxy.switch")

SIDE = Session(SIDE_SESSION, "side-request", persistent=False)


@contextlib.contextmanager
def side_task(switch: "SlotSwitch") -> Iterator["Lease"]:
    """The lease of a side task, with every slot of ``switch`` held until it ends. Slots are
    taken in ascending order, as every holder of several slots takes them, so two holders
    never wait for each other; the whole wait is bounded by the lock timeout (then
    ``SlotBusy``, a 503 with Retry-After)."""
    slots = sorted(switch.slot_ids())
    deadline = time.monotonic() + switch.lock_timeout
    taken: list[int] = []
    try:
        for slot in slots:
            switch.pool.lock(slot).acquire(timeout=max(0.0, deadline - time.monotonic()))
            taken.append(slot)
        leased = side_slot(switch.table.read(), slots)
        lease = switch.swap_held(leased, SIDE, placed="side")
        others = [slot for slot in slots if slot != leased]
        try:
            _save_unsaved(switch, others)
            try:
                yield lease
            finally:
                _mark_landed(switch, leased, others)
        finally:
            switch.release(lease)
    finally:
        for slot in reversed(taken):
            switch.give_back(slot)


def _save_unsaved(switch: "SlotSwitch", slots: list[int]) -> None:
    """Save each held slot whose session has turns its file lacks, so its file matches; each
    decided by the one save rule (``plan.save_or_keep``, on a fresh view of the slot)."""
    table = switch.table.read()
    for slot in slots:
        state = table.get(slot) or SlotState()
        if not save_before_side(state):
            continue
        decision, made_by = switch.housekeeping.save_decision(slot, state,
                                                              check_restoring=False)
        try:
            switch.executor.save_decided(decision, made_by, "before a side request")
        except StorageError as exc:
            log.warning("could not save session %s of slot %d before a side request: %s",
                        state.session_id, slot, exc)


def _mark_landed(switch: "SlotSwitch", leased: int, slots: list[int]) -> None:
    """Ask ``/slots`` once; mark every held slot whose contents changed as unproven."""
    if not slots:
        return
    try:
        listing = switch.llama_slots()
    except (UpstreamError, UpstreamUnavailable) as exc:
        log.warning("GET /slots failed after a side request (%s): slots %s are treated as "
                    "unproven", exc, slots)
        for slot in slots:
            switch.mark_unknown(slot)
        return
    table = switch.table.read()
    for slot in side_landed_in(table, listing, slots):
        log.info("llama-server ran the side request in slot %d, not in slot %d it was pinned "
                 "to: session %s there comes back from its file", slot, leased,
                 (table.get(slot) or SlotState()).session_id)
        switch.mark_unknown(slot)
