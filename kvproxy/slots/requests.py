"""The request path of the switch: lease a slot, swap it, and the bookkeeping after the answer.

``acquire`` takes the slot ``SlotPool`` picks (waiting, bounded) and swaps it (``SlotSwaps``);
``release`` gathers what the answer showed into ``answer.AnswerFacts``, lets
``answer.after_answer`` decide the bookkeeping and the executor carry it out, then frees the
slot (kept a few seconds for the conversation's next turn) and arms the save behind.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from kvproxy.telemetry import metrics
from kvproxy.sessions.identity import Session
from kvproxy.slots import answer
from kvproxy.slots.lease import Lease
from kvproxy.slots.lock import ClientGone, SlotUnavailable
from kvproxy.slots.outcome import HeldElsewhere, PromptView
from kvproxy.slots.plan import fingerprint_key
from kvproxy.storage.store import StorageError, now_iso
from kvproxy.upstream.llama import UpstreamError, UpstreamUnavailable

if TYPE_CHECKING:
    from kvproxy.slots.switch import SlotSwitch

log = logging.getLogger("kvproxy.switch")


class SlotRequests:
    """Leases slots to requests and does their bookkeeping once answered."""

    def __init__(self, switch: "SlotSwitch"):
        self.switch = switch
        self.busy_since: dict[int, str] = {}  # slot -> when the request holding it took it

    def acquire(self, session: Session, *, still_wanted: Callable[[], bool] | None = None,
                prompt: PromptView | None = None) -> Lease:
        """Wait (bounded) for a slot, then swap it to ``session``.

        Whatever fails on the way frees the slot. A failure that is not
        llama-server's answer or absence becomes ``SlotUnavailable`` (503).
        When the request had to wait and ``still_wanted`` says its client has
        left, nothing is swapped (``ClientGone``).
        """
        switch = self.switch
        pool = switch.pool
        deadline = time.monotonic() + switch.settings.lock_timeout
        waited_before = False
        began = switch.deletions.now()
        while True:
            slot, waited, placed = pool.take(
                switch.slot_ids(), session.key, not session.persistent,
                timeout=max(0.0, deadline - time.monotonic()),
                short=lambda: self.returning(session))
            waited = waited or waited_before
            taken_at = time.monotonic()
            try:
                if waited and still_wanted is not None and not still_wanted():
                    metrics.REJECTED.labels("client_gone").inc()
                    log.info("client of session %s left while waiting for the slot: no swap",
                             session.id)
                    raise ClientGone()
                lease = switch.swaps.swap_to(session, prompt, slot, placed)
            except HeldElsewhere:
                pool.give_back(slot)
                waited_before = True
                continue
            except BaseException as exc:
                if isinstance(exc, ClientGone):
                    pool.give_back(slot)
                    raise
                switch.executor.swap_failed(slot)
                pool.give_back(slot)
                if isinstance(exc, (UpstreamError, UpstreamUnavailable, SlotUnavailable,
                                    StorageError)) or not isinstance(exc, Exception):
                    raise
                log.exception("swapping slot %d to session %s failed", slot, session.id)
                raise SlotUnavailable(f"the slot could not be prepared ({exc.__class__.__name__}); "
                                      "see kvproxy's log") from exc
            self.busy_since[slot] = now_iso()
            lease.leased_at = taken_at
            lease.began = began
            # kept a few seconds for the conversation's next turn (pool.give_back)
            keep_for = lease.session.key if lease.session.persistent else None
            lease._release = lambda: pool.give_back(slot, keep_for)
            return lease

    def returning(self, session: Session) -> bool:
        """A conversation a slot holds, or with a file of its own (on the model last seen
        running): its turn is a hit or a restore and its new tokens, not a whole prefill, so
        it waits ahead of new conversations (``pool.queue_position``). Asks llama-server
        nothing."""
        if not session.persistent:
            return False
        switch = self.switch
        try:
            if any(state.key == session.key for state in switch.table.read().values()):
                return True  # in a slot, or being saved from one by the swap that evicts it
        except (OSError, StorageError):
            return False  # the swap meets the same failure and answers for it
        model = session.model or switch.fingerprints.last_model()
        return switch.store.has_bin(session.on_model(model).stem)

    def release(self, lease: Lease, timings: dict | None = None) -> None:
        """Record what the request showed about the cache, then free the slot. Idempotent."""
        unlock, lease._release = lease._release, None
        if unlock is None:
            return
        switch = self.switch
        try:
            self.after_request(lease, timings or {})
        except Exception:  # bookkeeping must never keep the slot locked
            log.exception("recording the request of session %s failed", lease.session.id)
        finally:
            self.busy_since.pop(lease.slot, None)
            if lease.leased_at:
                metrics.SLOT_BUSY_SECONDS.labels(str(lease.slot)).inc(
                    time.monotonic() - lease.leased_at)
            unlock()
            if switch.saver is not None and lease.session.persistent:
                switch.saver.arm(lease.slot)

    def after_request(self, lease: Lease, timings: dict) -> None:
        """The facts the answer showed, the bookkeeping ``answer.after_answer`` decides on
        them, carried out by the executor."""
        switch = self.switch
        executor = switch.executor
        session, slot = lease.session, lease.slot
        # What the request reused and computed, the base prefill of its swap counted as
        # computed (the metric counted that prefill when it was made).
        figures = lease.figures(timings)
        switch.activity.record(lease, figures)
        deleted = session.persistent and switch.deletions.undone(session.id, lease.began)
        if deleted:
            # Deleted while this lease ran (its swap may have restored the old file): the
            # slot must neither serve it as a hit nor save it back.
            log.info("session %s was deleted during its request: slot %d keeps nothing of it",
                     session.id, slot)
            facts = answer.AnswerFacts(slot, session, lease.cache, timings, figures,
                                       deleted=True)
            executor.carry_out(answer.after_answer(facts))
            return
        witness = switch.client.witness()  # before /slots may be asked below
        # What the slot now holds: compared with /slots before the next swap. An answer
        # that ended without timings (cut short at shutdown, client gone) asks /slots, while
        # the lock still keeps everyone else out, so the next swap or the save at shutdown
        # can still prove the slot is this session's.
        held = answer.held_by_timings(timings) if timings else executor.facts.held_now(slot)
        used_at = now_iso()
        switch.pool.note_use(slot, used_at)  # this process keeps it exactly, in memory
        memory = executor.memory
        facts = answer.AnswerFacts(
            slot, session, lease.cache, timings, figures,
            state=executor.recorded(slot, switch.table.get(slot)),
            swapped=memory.unrecorded(slot), held=held, used_at=used_at,
            several_slots=len(switch.slot_ids()) > 1,
            since_written=memory.since_used_at_written(slot, time.monotonic()),
            restored_stem=lease.restored_stem, restored_saved_at=lease.restored_saved_at,
            restore_note=lease.restore_note(),
            fingerprint=fingerprint_key(lease.made_by) if lease.made_by else "",
            lease=lease, witness=witness, now=now_iso())
        executor.carry_out(answer.after_answer(facts))
