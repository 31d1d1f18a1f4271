"""Swapping one held slot to a session: facts in, ``plan.plan_swap``, ``SlotExecutor.carry_out``.

The swap of the request path (``requests``) and of the housekeeping (``clear``, side tasks).
Before a swap is planned, a llama-server that may have restarted is learned again (its slots,
their sizes, its fingerprint) and, when its KV format is not known yet, the restore probe runs
in the slot about to be swapped (``restore_probe``).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Callable

from kvproxy.telemetry import metrics
from kvproxy.sessions.identity import Session
from kvproxy.slots import instance, plan, restore_probe
from kvproxy.slots.lease import Lease
from kvproxy.slots.outcome import HeldElsewhere, PromptView
from kvproxy.slots.plan import EMPTY, HIT, UNKNOWN, fingerprint_key, incoming_stems
from kvproxy.slots.state import Phase, SlotState, emptied
from kvproxy.upstream.llama import UpstreamError, UpstreamUnavailable

if TYPE_CHECKING:
    from kvproxy.slots.switch import SlotSwitch

log = logging.getLogger("kvproxy.switch")


class SlotGone(HeldElsewhere):
    """The leased slot no longer exists (llama-server restarted with fewer): place again."""


class SlotSwaps:
    """Swaps a slot the caller holds to a session, and learns a restarted llama-server."""

    def __init__(self, switch: "SlotSwitch"):
        self.switch = switch
        self.executor = switch.executor
        self.memory = switch.executor.memory
        self.facts = switch.executor.facts
        self.probe_due = False  # llama-server restarted: its KV format is not known yet

    def swap_to(self, session: Session, prompt: PromptView | None, slot: int,
                placed: str = "") -> Lease:
        """Swap ``slot`` (held by the caller) to ``session``; a hit does nothing."""
        switch = self.switch
        started = time.monotonic()
        self.executor.touch(slot)  # until its record is read, a failure trusts nothing
        state = switch.table.get(slot)
        self.executor.begin(slot, state)
        view = plan.UNASKED
        if state.key == session.key:
            view = self.facts.view(state, slot, trust_connection=True)
            if plan.is_hit(state, session.key, view):
                metrics.SWAPS.labels("none").inc()
                metrics.SLOT_SWAPS.labels(str(slot), "none").inc()
                # a hit needs no restore check: no prompt
                return Lease(session.on_model(state.model), HIT, slot=slot)
        asked_for = session
        if self.memory.restart or not switch.fingerprints.proven_same():
            state, view = self._same_llama_server(slot, state, view, started)
        made_by, asking = switch.fingerprints.for_swap()
        session = session.on_model(plan.model_of(made_by))
        # The files this swap may restore stay until it is done (eviction by other slots and
        # by its own saves); a stored start of its prompt joins them once it is found.
        with contextlib.ExitStack() as pins:
            pins.enter_context(switch.files.pinned(incoming_stems(session)))
            return self._fill(asked_for, session, prompt, slot, placed, state, view, made_by,
                              asking, started,
                              lambda stems: pins.enter_context(switch.files.pinned(stems)))

    def _fill(self, asked_for: Session, session: Session, prompt: PromptView | None,
              slot: int, placed: str, state: SlotState, view: str, made_by: dict, asking,
              started: float, pin: Callable[[set[str]], object]) -> Lease:
        """The rest of a swap that is not a hit: plan it from the facts, carry it out;
        ``pin`` keeps more files from eviction until the swap is done."""
        switch = self.switch
        restoring_off = switch.restore_check.restoring_off(fingerprint_key(made_by))
        if view == plan.UNASKED and plan.swap_needs_view(state, session, restoring_off):
            view = self.facts.view(state, slot)
        if restoring_off and view == EMPTY and state.tokens > 0:
            # The slot lost what kvproxy left in it: llama-server restarted, maybe with the
            # fix (--swa-full). Measure again rather than wait out the switch-off.
            log.info("slot %d was emptied while restoring is off: probing restores again", slot)
            self.executor.touch(slot)
            restore_probe.probe_slot(switch, switch.client, slot, state)
            made_by, asking = switch.current_made_by(), None
            restoring_off = switch.restore_check.restoring_off(fingerprint_key(made_by))
        facts = self.facts.swap_facts(slot, state, session, view, made_by, restoring_off,
                                      switch.settings.base_snapshots, prompt, pin)
        actions = plan.plan_swap(facts)
        if asking is not None and not plan.undoable(actions):
            if asking.changed(made_by) is not None:
                self.memory.note_restart("its fingerprint changed")
                return self.swap_to(asked_for, prompt, slot, placed)  # planned afresh
            asking = None
        filled = self.executor.carry_out(actions, made_by, prompt, switch.slot_ids(),
                                         keep=plan.restorable_stems(facts),
                                         beside_restore=asking.start if asking else None)
        if asking is not None and asking.changed(made_by) is not None:
            log.warning("llama-server changed during the swap of slot %d (its fingerprint "
                        "differs from the last one seen): swapping again", slot)
            self.executor.mark_unproven(slot)
            self.memory.note_restart("its fingerprint changed")
            return self.swap_to(asked_for, prompt, slot, placed)
        metrics.SLOT_SWAPS.labels(str(slot), filled.cache).inc()
        swap_ms = (time.monotonic() - started) * 1000
        log.info("swap to session=%s source=%s cache=%s slot=%s restored_tokens=%d swap_ms=%.1f "
                 "id_slot=%d placed=%s", session.id, session.source, filled.cache, view,
                 filled.tokens, swap_ms, slot, placed or "admin")
        fetched = next((found for found in (facts.own, facts.seed, facts.base, facts.prefix)
                        if found is not None and found.stem == filled.stem), None)
        return Lease(session, filled.cache, filled.tokens, swap_ms, filled.stem, made_by,
                     prompt, slot=slot, prefill=filled.prefill, restore_ms=filled.restore_ms,
                     restored_saved_at=filled.saved_at,
                     fetched_ms=fetched.fetched_ms if fetched is not None else None)

    def swap_held(self, slot: int, session: Session, placed: str) -> Lease:
        """Swap ``slot``, which the caller holds and frees itself (side tasks), to ``session``;
        ``release`` then only does the request's bookkeeping."""
        try:
            lease = self.swap_to(session, None, slot, placed)
        except BaseException:
            self.executor.swap_failed(slot)
            raise
        lease._release = lambda: None
        return lease

    def _same_llama_server(self, slot: int, state: SlotState, view: str,
                           since: float) -> tuple[SlotState, str]:
        """Nothing proves llama-server is the process kvproxy learned its facts from (the
        connection of the last fingerprint is closed): ``/slots`` tells (``instance.restarted``;
        its answer is the slot's view too, and it is not asked again when this swap asked it
        already). A new process is learned afresh before anything is planned, so no file goes
        to a server that cannot take it and no slot id wraps onto another slot. Returns the
        slot's record and view from then on."""
        switch = self.switch
        if view == plan.UNASKED:
            view = self.facts.view(state, slot)  # reads /slots unless the slot is unproven
        if self.memory.listed_at < since:
            try:
                self.facts.slot_entry(slot)
            except (UpstreamError, UpstreamUnavailable):
                return state, view  # the swap meets the same failure and answers for it
        if self.memory.restart:
            self._learn_again(self.memory.forget_instance())
        if slot not in switch.slot_ids():
            raise SlotGone()
        if not self.probe_due:
            return state, view
        # The new process holds nothing of kvproxy's: this slot is spare for the probe.
        self.probe_due = False
        self.executor.touch(slot)
        if restore_probe.probe_slot(switch, switch.client, slot, state).touched:
            self.memory.ran_a_task()
        state = switch.table.get(slot)
        return state, EMPTY if state.phase is Phase.EMPTY else UNKNOWN

    def _learn_again(self, reason: str | None) -> None:
        """llama-server restarted: the slots to drive, their sizes and its fingerprint are
        learned from the new process; slots it no longer has are emptied in the table."""
        switch, settings = self.switch, self.switch.settings
        listed = self.memory.listed
        total = len(listed.n_ctx) if listed else None
        switch.fingerprints.forget()
        self.probe_due = True
        old = switch.drive(instance.driven_slots(settings.slots, settings.slot_id, total))
        log.warning("llama-server restarted (%s): learning it again; driving slot(s) %s (was %s)",
                    reason, switch.slot_ids(), old)
        if total is not None and settings.slot_id >= total and settings.slots == 1:
            log.error("KVPROXY_SLOT_ID=%d, but llama-server now has %d slot(s): it wraps the id "
                      "onto another slot; set KVPROXY_SLOT_ID below %d", settings.slot_id,
                      total, total)
        if total is not None:
            def gone(table: dict[int, SlotState]) -> None:
                for slot, state in table.items():
                    if slot >= total and state.phase is not Phase.EMPTY:
                        table[slot] = emptied(state, False)
            switch.table.change(gone)
