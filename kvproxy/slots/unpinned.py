"""Side tasks llama-server runs in a slot of its own choosing, whatever kvproxy pinned.

llama-server reads ``id_slot`` only for completions. Embeddings, rerank and
decisions (``/v1/systemone``) never set it, and a transcription comes as a
form kvproxy cannot pin: each task goes to the least recently used idle slot,
one slot per input, and overwrites what that slot held. With one slot that is
the leased slot. With several it can be another idle slot holding a
conversation whose newest turns are not in its file yet.

So while such a request runs, ``protect_other_slots`` holds every other slot
it can take without waiting (a slot a request holds is left alone: it is
processing, or about to be), saves the sessions there that have unsaved
turns, and afterwards marks each slot the request ran in as unproven, so its
session comes back from its file. The decisions are ``plan.save_before_side``
and ``plan.side_landed_in``.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Iterator

from kvproxy.upstream.llama import UpstreamError, UpstreamUnavailable
from kvproxy.slots.plan import OURS, save_before_side, side_landed_in
from kvproxy.slots.state import SlotState
from kvproxy.storage.store import StorageError

if TYPE_CHECKING:
    from kvproxy.slots.lease import Lease
    from kvproxy.slots.switch import SlotSwitch

log = logging.getLogger("kvproxy.switch")


@contextlib.contextmanager
def protect_other_slots(switch: "SlotSwitch", lease: "Lease") -> Iterator[None]:
    """Around a side request that holds ``lease``: nothing happens with a single slot."""
    others = [slot for slot in switch.slot_ids() if slot != lease.slot]
    if not others:
        yield
        return
    taken: list[int] = []
    try:
        taken = [slot for slot in others if switch.try_hold(slot)]
        _save_unsaved(switch, taken)
        try:
            yield
        finally:
            _mark_landed(switch, lease.slot, taken)
    finally:
        for slot in reversed(taken):
            switch.give_back(slot)


def _save_unsaved(switch: "SlotSwitch", slots: list[int]) -> None:
    """Save each held slot whose session has turns its file lacks, so its file matches."""
    table = switch.table.read()
    due = [slot for slot in slots if save_before_side(table.get(slot) or SlotState())]
    if not due:
        return
    made_by = switch.current_made_by()
    for slot in due:
        state = table[slot]
        view = switch.slot_view(state, slot)
        if view != OURS:
            log.info("not saving session %s before a side request: slot %d is %s",
                     state.session_id, slot, view)
            continue
        try:
            switch.save_held(slot, state, made_by)
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
