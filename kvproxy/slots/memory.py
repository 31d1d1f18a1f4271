"""What this process knows about each slot beyond the state file, kept in one place.

Which slots a failed swap left uncertain, what a running swap has not changed yet, the slots'
sizes and the last ``/slots`` listing, the connection to llama-server that existed when each
slot was last recorded (its "witness"), the KV format llama-server writes, the swaps done
whose record the table learns after the answer, and when each slot's last use was written.
Only the executor changes it, through these methods; everyone else reads.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from kvproxy.sessions.identity import Session
from kvproxy.slots import instance, plan
from kvproxy.slots.state import Phase, SlotState, claimed_for, filled_with
from kvproxy.telemetry.pace import Pace

log = logging.getLogger("kvproxy.switch")
PREFILL_LEAST_TOKENS = 64   # shorter prefills are mostly fixed costs: they tell no pace


class SlotMemory:
    """Per-slot facts of this process (none of them survives a restart of kvproxy)."""

    def __init__(self) -> None:
        self._uncertain: set[int] = set()           # a swap failed half-way: trust nothing
        self._untouched: dict[int, SlotState] = {}  # a running swap changed nothing there yet
        self.n_ctx: dict[int, int] = {}             # per slot, from /slots
        self._witness: dict[int, Any] = {}          # per slot, see facts.view
        self.kv_format: str | None = None           # what the last file read was written with
        self.listed: instance.Listing | None = None  # the last /slots listing's facts
        self.listed_at = float("-inf")              # when it was read (time.monotonic())
        self.restart: str | None = None             # a restart a listing showed, not acted on
        self.entries: dict[int, dict] = {}          # the last listing's entries, by slot
        # per slot: a swap done whose record the table learns with the request's own
        # bookkeeping (``recorded``); until then the table names the session as claimed
        self._unrecorded: dict[int, tuple[Session, int, str]] = {}
        # per slot: when this process last wrote its used_at alone (see answer.after_answer)
        self._used_at_written: dict[int, float] = {}
        # prompt tokens per second llama-server computed lately (fetch or compute: ``facts``)
        self.prefill = Pace(least_units=PREFILL_LEAST_TOKENS)

    # -- /slots --------------------------------------------------------------------------
    def note_listing(self, slots: Any) -> dict | None:
        """A ``/slots`` listing was read: its entries and sizes are remembered; one from another
        llama-server process than the last is noted in ``restart``."""
        listed = instance.of_listing(slots)
        self.restart = instance.restarted(self.listed, listed) or self.restart
        self.listed, self.listed_at = listed or self.listed, time.monotonic()
        self.entries = {e["id"]: e for e in slots
                        if isinstance(e, dict) and isinstance(e.get("id"), int)}
        if listed is not None:
            self.n_ctx = {id_: int(e["n_ctx"]) for id_, e in self.entries.items()
                          if e.get("n_ctx")}
        return listed

    def ran_a_task(self) -> None:
        """llama-server answered a task of kvproxy's: its task ids have started, so a listing
        that shows none comes from a process started since (``instance.restarted``)."""
        if self.listed is not None and self.listed.last_task < 0:
            self.listed = dataclasses.replace(self.listed, last_task=0)

    def note_restart(self, reason: str) -> None:
        """Something other than a listing showed that llama-server changed."""
        self.restart = self.restart or reason

    def forget_instance(self) -> str | None:
        """llama-server restarted: what was learned of the old process (KV format, open
        connections) no longer holds; the slot sizes are the listing's that showed the
        restart. Returns the restart's reason, and forgets it."""
        reason, self.restart = self.restart, None
        self._witness, self.kv_format = {}, None
        return reason

    def note_kv_format(self, found: str | None) -> None:
        """The KV format of a file llama-server wrote; a change from the last one (a restart
        with other cache types) is logged and becomes the fingerprint's."""
        if found and found != self.kv_format:
            if self.kv_format:
                log.warning("llama-server now writes KV format %s (was %s): files of the old "
                            "format are no longer offered to it", found, self.kv_format)
            self.kv_format = found

    # -- trust -----------------------------------------------------------------------------
    def uncertain(self, slot: int) -> bool:
        return slot in self._uncertain

    def distrust(self, slot: int) -> None:
        """Trust nothing ``slot`` holds until its next good swap."""
        self._uncertain.add(slot)
        self._unrecorded.pop(slot, None)

    def witness(self, slot: int) -> Any:
        return self._witness.get(slot)

    def note_witness(self, slot: int, witness: Any) -> None:
        self._witness[slot] = witness

    # -- a running swap --------------------------------------------------------------------
    def begin(self, slot: int, state: SlotState) -> None:
        """A swap of ``slot`` starts from ``state``: until an action changes the slot
        (``touch``), a failure leaves it as it was."""
        self._untouched[slot] = state

    def touch(self, slot: int) -> None:
        """An action is about to change what ``slot`` holds."""
        self._untouched.pop(slot, None)

    def untouched_before(self, slot: int) -> SlotState | None:
        """What ``slot`` held when its failed swap began, when no action changed it; forgotten."""
        return self._untouched.pop(slot, None)

    def claimed(self, slot: int) -> None:
        """A new swap claims ``slot``: an earlier unrecorded swap there is void."""
        self._unrecorded.pop(slot, None)

    def filled(self, slot: int, session: Session, tokens: int, at: str, witness: Any) -> None:
        """The swap is done: ``slot`` holds ``session``, proven from now on (``recorded``)."""
        self._unrecorded[slot] = (session, tokens, at)
        self._uncertain.discard(slot)
        self._witness[slot] = witness

    def recorded(self, slot: int, state: SlotState) -> SlotState:
        """``state``, the table's entry for ``slot``, with the swap done there that the table
        has not learnt yet (the holder of the slot writes it)."""
        done = self._unrecorded.get(slot)
        if done is None:
            return state
        if state.phase is not Phase.CLAIMED:  # the claim was lost with the state file
            state = claimed_for(state, done[0])
        return filled_with(state, *done)

    def unrecorded(self, slot: int) -> bool:
        return slot in self._unrecorded

    def writing(self, slot: int) -> None:
        """The slot's record is being written with its swap: the swap is no longer pending
        (a write that fails loses it, and the claim in the table leaves the slot untrusted)."""
        self._unrecorded.pop(slot, None)

    def written(self, slot: int, now: float) -> None:
        """The slot's record (and its last use) was written at ``now``."""
        self._used_at_written[slot] = now

    def since_used_at_written(self, slot: int, now: float) -> float:
        """Seconds since this process last wrote ``slot``'s last use."""
        return now - self._used_at_written.get(slot, -plan.USED_AT_RESOLUTION_S)
