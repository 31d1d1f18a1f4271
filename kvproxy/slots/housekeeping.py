"""The switch's housekeeping: clear, forget, checkpoint, and saving a settled slot behind.

Each holds its slot like a request. Every save here is decided by the one save rule
(``plan.save_or_keep``: only a slot a fresh view of ``/slots`` proves to hold its session is
saved over its file) and carried out by the executor, as the swap's own saves and those before
a side request (``unpinned``).
"""
from __future__ import annotations

import glob
import logging
import time
from typing import TYPE_CHECKING

from kvproxy.telemetry import metrics
from kvproxy.sessions.identity import DEFAULT_SESSION, MODEL_SEPARATOR, Session, file_stem
from kvproxy.slots import plan
from kvproxy.slots.lock import SlotUnavailable
from kvproxy.slots.plan import HIT, OURS, KeepFile, Save, WriteRecord, fingerprint_key
from kvproxy.slots.state import SlotState, emptied
from kvproxy.storage.store import CHUNKED_SUFFIX, StorageError
from kvproxy.upstream.llama import UpstreamError, UpstreamUnavailable

if TYPE_CHECKING:
    from kvproxy.slots.switch import SlotSwitch

log = logging.getLogger("kvproxy.switch")


class SlotHousekeeping:
    """kvproxy's own slot actions, outside any client request."""

    def __init__(self, switch: "SlotSwitch"):
        self.switch = switch
        self.executor = switch.executor

    def save_decision(self, slot: int, state: SlotState, check_restoring: bool = True,
                      again: bool = False) -> tuple[Save | KeepFile, dict | None]:
        """``plan.save_or_keep`` on a fresh view of the slot, and the fingerprint a save is
        made for (asked only when the view proves the slot: behind a router, ``/props`` loads
        an unloaded model again). ``check_restoring``: a save behind is not made while
        restoring is off (the swap's rule); the checkpoint and side requests save anyway."""
        view = self.executor.facts.view(state, slot)
        made_by = self.switch.current_made_by() if view == OURS else None
        restoring_off = check_restoring and made_by is not None and \
            self.switch.restore_check.restoring_off(fingerprint_key(made_by))
        return plan.save_or_keep(slot, state, view, restoring_off, again), made_by

    def save_settled(self, slot: int) -> bool:
        """Save the new turns of the session ``slot`` holds, in the background, if the slot is
        free now: never waits for it, and saves only what kvproxy can prove is there, with
        restoring on (``plan.save_or_keep``). True when a save was made."""
        switch = self.switch
        if not switch.pool.hold_for_save(slot):
            return False  # a request holds it: it arms the slot again when it ends
        try:
            state = switch.table.get(slot)
            if not plan.worth_saving(state):
                return False
            decision, made_by = self.save_decision(slot, state)
            started = time.monotonic()
            saved = self.executor.save_decided(decision, made_by, "in the background") \
                is not None
            if saved:
                metrics.SAVES_BEHIND.inc()
                log.info("saved session %s from slot %d in the background (%d tokens, %.0f ms)",
                         state.session_id, slot, state.tokens,
                         (time.monotonic() - started) * 1000)
            return saved
        except (UpstreamError, UpstreamUnavailable, StorageError) as exc:
            log.warning("could not save slot %d in the background: %s", slot, exc)
            return False
        finally:
            switch.give_back(slot)

    def clear(self, slot: int | None = None) -> list[int]:
        """Save what a slot (default: every slot) holds, erase it and make ``default`` its
        session; waits for each slot like a request. Returns the slots cleared."""
        switch = self.switch
        slots = switch.slot_ids() if slot is None else [slot]
        for one in slots:
            switch.pool.lock(one).acquire()
            lease = None
            try:
                lease = switch.swaps.swap_to(Session(DEFAULT_SESSION, "admin", persistent=False),
                                             None, one)
                if lease.cache == HIT:
                    self.executor.erase(one)
            except BaseException:
                self.executor.mark_unproven(one)
                raise
            finally:
                if lease is not None:
                    lease._release = lambda one=one: switch.pool.give_back(one)
                    switch.release(lease)
                else:
                    switch.pool.give_back(one)
        return slots

    def checkpoint(self, timeout: float = 10, unsaved_only: bool = False) -> bool:
        """Save the session of every slot now (at shutdown, or before llama-server's router
        loads another model), so a later restart or unload loses nothing; ``unsaved_only``:
        only sessions with turns their file lacks. True when at least one was saved."""
        deadline = time.monotonic() + timeout
        saved = [self._checkpoint_slot(slot, max(0.0, deadline - time.monotonic()), unsaved_only)
                 for slot in self.switch.slot_ids()]
        self.switch.store.notes.flush()   # what answers taught the sidecars, held until now
        return any(saved)

    def _checkpoint_slot(self, slot: int, timeout: float, unsaved_only: bool = False) -> bool:
        switch = self.switch
        try:
            switch.pool.lock(slot).acquire(timeout)
        except SlotUnavailable:
            log.warning("slot %d stayed busy: its session was not saved", slot)
            return False
        try:
            state = switch.table.get(slot)
            if unsaved_only and not plan.worth_saving(state):
                return False
            if not state.keeps_file:
                return False
            decision, made_by = self.save_decision(slot, state, check_restoring=False,
                                                   again=not unsaved_only)
            return self.executor.save_decided(decision, made_by, "at the checkpoint") is not None
        except (UpstreamError, UpstreamUnavailable, StorageError) as exc:
            log.warning("could not save the active session of slot %d at shutdown: %s", slot, exc)
            return False
        finally:
            switch.pool.give_back(slot)

    def forget(self, session_id: str) -> bool:
        """Delete a session's (or base snapshot's) files; erase every slot that holds it. No
        request that began before it may record the session again (``Deletions``)."""
        with self.switch.deletions.deleting(session_id):
            self.empty_slots_of(session_id)
            return self.delete_files(session_id)

    def empty_slots_of(self, session_id: str, loaded: bool = True) -> None:
        """Erase every slot that holds ``session_id`` and record it empty, waiting for each like
        a request. With llama-server down (or, behind a router, the model not loaded:
        ``loaded=False`` asks nothing that would load it) the slot is no longer trusted
        instead, so what it holds is never saved or served again."""
        switch = self.switch
        holders = [slot for slot, state in switch.table.read().items()
                   if state.session_id == session_id]
        for slot in holders:
            if loaded and slot not in switch.slot_ids():
                continue
            switch.pool.lock(slot).acquire()
            try:
                state = switch.table.get(slot)
                if state.session_id != session_id:
                    continue
                if not loaded:
                    self.executor.distrust(slot)
                else:
                    try:
                        self.executor.erase(slot, autoload=False)
                    except (UpstreamError, UpstreamUnavailable) as exc:
                        log.warning("could not erase slot %d of deleted session %s: %s",
                                    slot, session_id, exc)
                        self.executor.distrust(slot)
                unproven = self.executor.memory.uncertain(slot)
                self.executor.carry_out([WriteRecord(slot, emptied(state, unproven))])
            finally:
                switch.pool.give_back(slot)

    def delete_files(self, session_id: str) -> bool:
        """Delete every file of ``session_id``, of any model; False when there was none. Called
        once its slots are emptied, so a save they made meanwhile goes too."""
        store = self.switch.store
        stems = {s["stem"] for s in store.sidecars() if s.get("session_id") == session_id}
        # a file left without its sidecar, of any model
        for suffix in (".bin", CHUNKED_SUFFIX):
            stems |= {path.name[:-len(suffix)] for path in store.root.glob(
                f"{glob.escape(file_stem(session_id))}{MODEL_SEPARATOR}*{suffix}")}
        stems.add(file_stem(session_id))
        removed = [self.switch.files.delete(stem) for stem in stems]
        return any(removed)
