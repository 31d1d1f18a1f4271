"""The one place that decides what each llama-server slot holds.

A request takes a ``Lease`` on one slot (``SlotPool`` picks it, see
``placement``): the lease swaps that slot to the request's session (save the
old one, restore or erase for the new one) and is held until the request's
last byte, because llama-server queues slot actions behind a running
generation and a completion could overtake a queued save. Every upstream call
of the lease is pinned to its slot. Nothing here knows a client wire format.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import time
from typing import Callable, Iterator

from kvproxy.telemetry import metrics
from kvproxy.telemetry.activity import RecentActivity
from kvproxy.sessions.identity import DEFAULT_SESSION, MODEL_SEPARATOR, Session, file_stem
from kvproxy.slots import instance, plan, restore_probe
from kvproxy.slots.deletions import Deletions
from kvproxy.slots.fingerprints import Fingerprints
from kvproxy.slots.lease import Lease
from kvproxy.slots.executor import (MIN_BASE_TOKENS, HeldElsewhere, PromptView,  # noqa: F401
                                    SlotExecutor)
from kvproxy.slots.lock import ClientGone, SlotBusy, SlotLock, SlotUnavailable
from kvproxy.slots.plan import (BASE, EMPTY, FOREIGN, HIT, MISS, OURS, RESTORED, UNKNOWN,
                                fingerprint, fingerprint_key, incoming_stems, judge_slot)
from kvproxy.slots.pool import SlotPool
from kvproxy.slots.restore_check import RestoreCheck, verify_restore
from kvproxy.slots.save_behind import SaveBehind
from kvproxy.slots.state import Phase, SlotState, SlotTable, emptied
from kvproxy.storage.folder import FolderFiles
from kvproxy.storage.store import SessionStore, StorageError, now_iso
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable

log = logging.getLogger("kvproxy.switch")


class SlotGone(HeldElsewhere):
    """The leased slot no longer exists (llama-server restarted with fewer): place again."""


__all__ = ["SlotSwitch", "Lease", "SlotBusy", "SlotUnavailable", "ClientGone", "HIT", "RESTORED",
           "BASE", "MISS", "judge_slot", "fingerprint", "fingerprint_key", "OURS",
           "EMPTY", "FOREIGN", "UNKNOWN"]


class SlotSwitch:
    """Leases llama-server's slots to requests and swaps each to its request's session.

    With one slot it behaves as kvproxy always did. With several, ``SlotPool``
    picks the slot (``placement``): the one holding the session, else an idle
    one, saving its session first when it holds one. What a swap does is
    decided by ``plan`` and carried out by ``SlotExecutor``.
    """

    def __init__(self, client: LlamaClient, store: SessionStore, slot_id: int = 0,
                 lock_timeout: float = 300, base_snapshots: bool = True,
                 restore_miss_limit: int = 2, max_disk_bytes: int = 0, min_free_bytes: int = 0,
                 max_waiters: int = 32, restore_off_minutes: float = 60, slots: int = 1,
                 save_behind: bool = False, save_behind_delay: float = 2,
                 slot_keep: float = 0):
        self.client = client
        self.store = store
        store.legacy_slot = slot_id
        self.table = SlotTable(store)
        self.activity = RecentActivity()  # recent swaps and outcomes, for /status and the CLI
        self.slot_id = slot_id            # the slot a single-slot kvproxy drives
        self.configured_slots = slots     # 0: as many as llama-server has
        self._slot_ids: list[int] | None = [slot_id] if slots == 1 else (
            list(range(slots)) if slots > 1 else None)
        self.base_snapshots = base_snapshots
        self.max_disk_bytes = max_disk_bytes
        self.lock_timeout = lock_timeout
        self.files = FolderFiles(store, max_disk_bytes, min_free_bytes)
        self.budget = self.files.budget
        self.pool = SlotPool(store, lock_timeout, max_waiters, keep=slot_keep)
        self.restore_check = RestoreCheck(store.root, restore_miss_limit, restore_off_minutes)
        self.executor = SlotExecutor(client, store, self.table, self.files)
        self._busy_since: dict[int, str] = {}
        # Per slot: when this process last wrote its used_at alone (see plan.after_answer).
        self._used_at_written: dict[int, float] = {}
        self.fingerprints = Fingerprints(client, lambda: self.kv_format)
        self._probe_due = False  # llama-server restarted: its KV format is not known yet
        # New turns saved in the background once a slot has settled (see save_behind).
        self.saver = SaveBehind(self.save_settled, save_behind_delay) if save_behind else None
        # Sessions deleted while leases ran (shared by every model's switch: ModelSwitches).
        self.deletions = Deletions()

    # -- the slots ---------------------------------------------------------
    def slot_ids(self) -> list[int]:
        """The slots kvproxy drives: ``KVPROXY_SLOTS``, else as many as llama-server reports
        (asked once it answers; until then the one slot ``KVPROXY_SLOT_ID``)."""
        if self._slot_ids is None:
            total = self._llama_slot_count()
            if total is None:
                return [self.slot_id]
            self._slot_ids = instance.driven_slots(self.configured_slots, self.slot_id, total)
            log.info("driving %d llama-server slot(s): %s", len(self._slot_ids), self._slot_ids)
        return self._slot_ids

    def _llama_slot_count(self) -> int | None:
        try:
            # autoload=False: behind a router, a listing must never load the model
            total = self.client.props(autoload=False).get("total_slots")
            if isinstance(total, int) and total > 0:
                return total
            slots = self.client.slots()
            return len(slots) if isinstance(slots, list) and slots else None
        except (UpstreamError, UpstreamUnavailable, AttributeError):
            return None

    @property
    def lock(self) -> SlotLock:
        """The lock of the first slot (the only one with a single slot)."""
        return self.pool.lock(self.slot_ids()[0])

    # -- locking -----------------------------------------------------------
    def acquire(self, session: Session, *, still_wanted: Callable[[], bool] | None = None,
                prompt: PromptView | None = None) -> Lease:
        """Wait (bounded) for a slot, then swap it to ``session``.

        Whatever fails on the way frees the slot. A failure that is not
        llama-server's answer or absence becomes ``SlotUnavailable`` (503).
        When the request had to wait and ``still_wanted`` says its client has
        left, nothing is swapped (``ClientGone``).
        """
        deadline = time.monotonic() + self.lock_timeout
        waited_before = False
        began = self.deletions.now()
        while True:
            slot, waited, placed = self.pool.take(
                self.slot_ids(), session.key, not session.persistent,
                timeout=max(0.0, deadline - time.monotonic()),
                short=lambda: self._returning(session))
            waited = waited or waited_before
            taken_at = time.monotonic()
            try:
                if waited and still_wanted is not None and not still_wanted():
                    metrics.REJECTED.labels("client_gone").inc()
                    log.info("client of session %s left while waiting for the slot: no swap",
                             session.id)
                    raise ClientGone()
                lease = self._swap_to(session, prompt, slot, placed)
            except HeldElsewhere:
                self.pool.give_back(slot)
                waited_before = True
                continue
            except BaseException as exc:
                if isinstance(exc, ClientGone):
                    self.pool.give_back(slot)
                    raise
                self.executor.swap_failed(slot)
                self.pool.give_back(slot)
                if isinstance(exc, (UpstreamError, UpstreamUnavailable, SlotUnavailable,
                                    StorageError)) or not isinstance(exc, Exception):
                    raise
                log.exception("swapping slot %d to session %s failed", slot, session.id)
                raise SlotUnavailable(f"the slot could not be prepared ({exc.__class__.__name__}); "
                                      "see kvproxy's log") from exc
            self._busy_since[slot] = now_iso()
            lease.leased_at = taken_at
            lease.began = began
            # kept a few seconds for the conversation's next turn (pool.give_back)
            keep_for = lease.session.key if lease.session.persistent else None
            lease._release = lambda: self.pool.give_back(slot, keep_for)
            return lease

    def _returning(self, session: Session) -> bool:
        """A conversation a slot holds, or with a file of its own (on the model last seen
        running): its turn is a hit or a restore and its new tokens, not a whole prefill, so
        it waits ahead of new conversations (``pool.queue_position``). Asks llama-server
        nothing."""
        if not session.persistent:
            return False
        try:
            if any(state.key == session.key for state in self.table.read().values()):
                return True  # in a slot, or being saved from one by the swap that evicts it
        except (OSError, StorageError):
            return False  # the swap meets the same failure and answers for it
        model = session.model or self.fingerprints.last_model()
        return self.store.has_bin(session.on_model(model).stem)

    def mark_unknown(self, slot: int) -> None:
        """After a failed swap: trust nothing the slot holds until its next good swap."""
        self.executor.mark_unproven(slot)

    @contextlib.contextmanager
    def holding(self, timeout: float, slots: list[int] | None = None) -> Iterator[bool]:
        """Every slot (or ``slots``), for kvproxy's own housekeeping (start-up sweep and checks):
        yields False, holding nothing, when they are not all free within ``timeout`` seconds."""
        taken: list[int] = []
        deadline = time.monotonic() + timeout
        try:
            for slot in (self.slot_ids() if slots is None else slots):
                try:
                    self.pool.lock(slot).acquire(timeout=max(0.0, deadline - time.monotonic()))
                except SlotUnavailable:
                    yield False
                    return
                taken.append(slot)
            yield True
        finally:
            for slot in reversed(taken):
                self.pool.give_back(slot)

    def try_hold(self, slot: int) -> bool:
        """Take ``slot`` only if it is free now (side requests protect idle slots this way)."""
        return self.pool.lock(slot).try_acquire()

    def give_back(self, slot: int) -> None:
        """Free a slot taken with ``try_hold`` or ``holding``."""
        self.pool.give_back(slot)

    def release(self, lease: Lease, timings: dict | None = None) -> None:
        """Record what the request showed about the cache, then free the slot. Idempotent."""
        unlock, lease._release = lease._release, None
        if unlock is None:
            return
        try:
            self._after_request(lease, timings or {})
        except Exception:  # bookkeeping must never keep the slot locked
            log.exception("recording the request of session %s failed", lease.session.id)
        finally:
            self._busy_since.pop(lease.slot, None)
            if lease.leased_at:
                metrics.SLOT_BUSY_SECONDS.labels(str(lease.slot)).inc(
                    time.monotonic() - lease.leased_at)
            unlock()
            if self.saver is not None and lease.session.persistent:
                self.saver.arm(lease.slot)

    def save_settled(self, slot: int) -> bool:
        """Save the new turns of the session ``slot`` holds, in the background, if the slot is
        free now: never waits for it, and saves only what kvproxy can prove is there, with
        restoring on (``plan.worth_saving``). True when a save was made."""
        if not self.pool.hold_for_save(slot):
            return False  # a request holds it: it arms the slot again when it ends
        try:
            state = self.table.get(slot)
            if not plan.worth_saving(state):
                return False
            # /slots first: behind a router, /props loads an unloaded model again
            view = self.slot_view(state, slot)
            if view != OURS:
                log.info("not saving session %s in the background: slot %d is %s",
                         state.session_id, slot, view)
                return False
            made_by = self.current_made_by()
            if self.restore_check.restoring_off(fingerprint_key(made_by)):
                return False
            started = time.monotonic()
            saved = self.save_held(slot, state, made_by) is not None
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
            self.give_back(slot)

    # -- swapping ----------------------------------------------------------
    def busy(self, slot: int) -> bool:
        """Whether a request (or an admin action) in this process holds ``slot`` now."""
        return slot in self.pool.busy_here()

    def busy_since(self, slot: int) -> str | None:
        """When the request holding ``slot`` took it: set once its swap is done, forgotten by
        ``release`` before the slot is freed, so an idle slot has none."""
        return self._busy_since.get(slot)

    def slot_listing(self) -> list[dict]:
        """Every driven slot as the admin API lists it: from the state table and this
        process's locks, without asking llama-server."""
        table = self.table.read()
        return [slot_row(slot, self.executor.recorded(slot, table.get(slot) or SlotState()),
                         self.busy(slot),
                         self.busy_since(slot), self.executor.n_ctx.get(slot))
                for slot in self.slot_ids()]

    def llama_slots(self) -> list:
        """llama-server's ``/slots`` listing, as it is now (raises when it cannot answer)."""
        return self.client.slots()

    def current_made_by(self) -> dict:
        """The running llama-server's fingerprint (``Fingerprints.now``)."""
        return self.fingerprints.now()

    @property
    def kv_format(self) -> str | None:
        """The KV cache layout llama-server writes (``slot_file.kv_format``): from the restore
        probe, then from every file saved, so a restart with other cache types shows at once."""
        return self.executor.kv_format

    @kv_format.setter
    def kv_format(self, value: str | None) -> None:
        self.executor.kv_format = value

    def slot_view(self, state: SlotState, slot: int, trust_connection: bool = False) -> str:
        """Whether the slot holds what kvproxy's last action left in it (``OURS``), or not."""
        return self.executor.view(state, slot, trust_connection)

    def save_held(self, slot: int, state: SlotState, made_by: dict,
                  keep: set[str] = frozenset()) -> dict | None:
        """Save the session ``state`` says ``slot`` holds into its own file (caller holds it)."""
        return self.executor.save_session(slot, state, made_by, keep)

    def _swap_to(self, session: Session, prompt: PromptView | None, slot: int,
                 placed: str = "") -> Lease:
        started = time.monotonic()
        self.executor.touch(slot)  # until its record is read, a failure trusts nothing
        state = self.table.get(slot)
        self.executor.begin(slot, state)
        view = plan.UNASKED
        if state.key == session.key:
            view = self.slot_view(state, slot, trust_connection=True)
            if plan.is_hit(state, session.key, view):
                metrics.SWAPS.labels("none").inc()
                metrics.SLOT_SWAPS.labels(str(slot), "none").inc()
                # a hit needs no restore check: no prompt
                return Lease(session.on_model(state.model), HIT, slot=slot)
        asked_for = session
        if self.executor.restart or not self.fingerprints.proven_same():
            state, view = self._same_llama_server(slot, state, view, started)
        made_by, asking = self.fingerprints.for_swap()
        session = session.on_model(plan.model_of(made_by))
        # The files this swap may restore stay until it is done (eviction by other slots).
        with self.files.pinned(incoming_stems(session)):
            return self._fill(asked_for, session, prompt, slot, placed, state, view, made_by,
                              asking, started)

    def _fill(self, asked_for: Session, session: Session, prompt: PromptView | None,
              slot: int, placed: str, state: SlotState, view: str, made_by: dict, asking,
              started: float) -> Lease:
        """The rest of a swap that is not a hit: plan it from the facts, carry it out."""
        restoring_off = self.restore_check.restoring_off(fingerprint_key(made_by))
        if view == plan.UNASKED and plan.swap_needs_view(state, session, restoring_off):
            view = self.slot_view(state, slot)
        if restoring_off and view == EMPTY and state.tokens > 0:
            # The slot lost what kvproxy left in it: llama-server restarted, maybe with the
            # fix (--swa-full). Measure again rather than wait out the switch-off.
            log.info("slot %d was emptied while restoring is off: probing restores again", slot)
            self.executor.touch(slot)
            restore_probe.probe_slot(self, self.client, slot, state)
            made_by, asking = self.current_made_by(), None
            restoring_off = self.restore_check.restoring_off(fingerprint_key(made_by))
        facts = self.executor.swap_facts(slot, state, session, view, made_by, restoring_off,
                                         self.base_snapshots, prompt is not None)
        actions = plan.plan_swap(facts)
        if asking is not None and not plan.undoable(actions):
            if asking.changed(made_by) is not None:
                self.executor.restart = self.executor.restart or "its fingerprint changed"
                return self._swap_to(asked_for, prompt, slot, placed)  # planned afresh
            asking = None
        filled = self.executor.carry_out(actions, made_by, prompt, self.slot_ids(),
                                         keep=incoming_stems(session),
                                         beside_restore=asking.start if asking else None)
        if asking is not None and asking.changed(made_by) is not None:
            log.warning("llama-server changed during the swap of slot %d (its fingerprint "
                        "differs from the last one seen): swapping again", slot)
            self.executor.mark_unproven(slot)
            self.executor.restart = self.executor.restart or "its fingerprint changed"
            return self._swap_to(asked_for, prompt, slot, placed)
        metrics.SLOT_SWAPS.labels(str(slot), filled.cache).inc()
        swap_ms = (time.monotonic() - started) * 1000
        log.info("swap to session=%s source=%s cache=%s slot=%s restored_tokens=%d swap_ms=%.1f "
                 "id_slot=%d placed=%s", session.id, session.source, filled.cache, view,
                 filled.tokens, swap_ms, slot, placed or "admin")
        return Lease(session, filled.cache, filled.tokens, swap_ms, filled.stem, made_by,
                     prompt, slot=slot, prefill=filled.prefill, restore_ms=filled.restore_ms,
                     restored_saved_at=filled.saved_at)

    def swap_held(self, slot: int, session: Session, placed: str) -> Lease:
        """Swap ``slot``, which the caller holds and frees itself (side tasks), to ``session``;
        ``release`` then only does the request's bookkeeping."""
        try:
            lease = self._swap_to(session, None, slot, placed)
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
        if view == plan.UNASKED:
            view = self.slot_view(state, slot)  # reads /slots unless the slot is unproven
        if self.executor.listed_at < since:
            try:
                self.executor.slot_entry(slot)
            except (UpstreamError, UpstreamUnavailable):
                return state, view  # the swap meets the same failure and answers for it
        if self.executor.restart:
            self._learn_again(self.executor.forget_instance())
        if slot not in self.slot_ids():
            raise SlotGone()
        if not self._probe_due:
            return state, view
        # The new process holds nothing of kvproxy's: this slot is spare for the probe.
        self._probe_due = False
        self.executor.touch(slot)
        if restore_probe.probe_slot(self, self.client, slot, state).touched:
            self.executor.ran_a_task()
        state = self.table.get(slot)
        return state, EMPTY if state.phase is Phase.EMPTY else UNKNOWN

    def _learn_again(self, reason: str | None) -> None:
        """llama-server restarted: the slots to drive, their sizes and its fingerprint are
        learned from the new process; slots it no longer has are emptied in the table."""
        listed = self.executor.listed
        total = len(listed.n_ctx) if listed else None
        self.fingerprints.forget()
        self._probe_due = True
        old, self._slot_ids = self._slot_ids, instance.driven_slots(
            self.configured_slots, self.slot_id, total)
        log.warning("llama-server restarted (%s): learning it again; driving slot(s) %s (was %s)",
                    reason, self.slot_ids(), old)
        if total is not None and self.slot_id >= total and self.configured_slots == 1:
            log.error("KVPROXY_SLOT_ID=%d, but llama-server now has %d slot(s): it wraps the id "
                      "onto another slot; set KVPROXY_SLOT_ID below %d", self.slot_id, total, total)
        if total is not None:
            def gone(table: dict[int, SlotState]) -> None:
                for slot, state in table.items():
                    if slot >= total and state.phase is not Phase.EMPTY:
                        table[slot] = emptied(state, False)
            self.table.change(gone)

    def clear(self, slot: int | None = None) -> list[int]:
        """Save what a slot (default: every slot) holds, erase it and make ``default`` its
        session; waits for each slot like a request. Returns the slots cleared."""
        slots = self.slot_ids() if slot is None else [slot]
        for one in slots:
            self.pool.lock(one).acquire()
            lease = None
            try:
                lease = self._swap_to(Session(DEFAULT_SESSION, "admin", persistent=False), None, one)
                if lease.cache == HIT:
                    self.executor.erase(one)
            except BaseException:
                self.mark_unknown(one)
                raise
            finally:
                if lease is not None:
                    lease._release = lambda one=one: self.pool.give_back(one)
                    self.release(lease)
                else:
                    self.pool.give_back(one)
        return slots

    def checkpoint(self, timeout: float = 10, unsaved_only: bool = False) -> bool:
        """Save the session of every slot now (at shutdown, or before llama-server's router
        loads another model), so a later restart or unload loses nothing; ``unsaved_only``:
        only sessions with turns their file lacks. True when at least one was saved."""
        deadline = time.monotonic() + timeout
        saved = [self._checkpoint_slot(slot, max(0.0, deadline - time.monotonic()), unsaved_only)
                 for slot in self.slot_ids()]
        return any(saved)

    def _checkpoint_slot(self, slot: int, timeout: float, unsaved_only: bool = False) -> bool:
        try:
            self.pool.lock(slot).acquire(timeout)
        except SlotUnavailable:
            log.warning("slot %d stayed busy: its session was not saved", slot)
            return False
        try:
            state = self.table.get(slot)
            if unsaved_only and not plan.worth_saving(state):
                return False
            if not state.keeps_file or self.slot_view(state, slot) != OURS:
                return False
            return self.save_held(slot, state, self.current_made_by()) is not None
        except (UpstreamError, UpstreamUnavailable, StorageError) as exc:
            log.warning("could not save the active session of slot %d at shutdown: %s", slot, exc)
            return False
        finally:
            self.pool.give_back(slot)

    def forget(self, session_id: str) -> bool:
        """Delete a session's (or base snapshot's) files; erase every slot that holds it. No
        request that began before it may record the session again (``Deletions``)."""
        with self.deletions.deleting(session_id):
            self.empty_slots_of(session_id)
            return self.delete_files(session_id)

    def empty_slots_of(self, session_id: str, loaded: bool = True) -> None:
        """Erase every slot that holds ``session_id`` and record it empty, waiting for each like
        a request. With llama-server down (or, behind a router, the model not loaded:
        ``loaded=False`` asks nothing that would load it) the slot is no longer trusted
        instead, so what it holds is never saved or served again."""
        holders = [slot for slot, state in self.table.read().items()
                   if state.session_id == session_id]
        for slot in holders:
            if loaded and slot not in self.slot_ids():
                continue
            self.pool.lock(slot).acquire()
            try:
                state = self.table.get(slot)
                if state.session_id != session_id:
                    continue
                if not loaded:
                    self.executor.uncertain.add(slot)
                else:
                    try:
                        self.executor.erase(slot, autoload=False)
                    except (UpstreamError, UpstreamUnavailable) as exc:
                        log.warning("could not erase slot %d of deleted session %s: %s",
                                    slot, session_id, exc)
                        self.executor.uncertain.add(slot)
                self.table.put(slot, emptied(state, slot in self.executor.uncertain))
            finally:
                self.pool.give_back(slot)

    def delete_files(self, session_id: str) -> bool:
        """Delete every file of ``session_id``, of any model; False when there was none. Called
        once its slots are emptied, so a save they made meanwhile goes too."""
        stems = {s["stem"] for s in self.store.sidecars() if s.get("session_id") == session_id}
        # a file left without its sidecar, of any model
        stems |= {path.name[:-len(".bin")] for path in self.store.root.glob(
            f"{glob.escape(file_stem(session_id))}{MODEL_SEPARATOR}*.bin")}
        stems.add(file_stem(session_id))
        removed = [self.store.delete(stem) for stem in stems]
        return any(removed)

    # -- after the request -------------------------------------------------
    def _after_request(self, lease: Lease, timings: dict) -> None:
        session = lease.session
        # What the request reused and computed, the base prefill of its swap counted as
        # computed (the metric counted that prefill when it was made).
        figures = lease.figures(timings)
        cache_n = int(figures.get("cache_n") or 0)
        prompt_n = int(figures.get("prompt_n") or 0)
        metrics.TOKENS.labels("reused").inc(cache_n)
        metrics.TOKENS.labels("computed").inc(int(timings.get("prompt_n") or 0))
        self.activity.record(lease, figures)
        slot = lease.slot
        if timings:
            self.executor.ran_a_task()
        if session.persistent and self.deletions.undone(session.id, lease.began):
            # Deleted while this lease ran (its swap may have restored the old file): the
            # slot must neither serve it as a hit nor save it back.
            log.info("session %s was deleted during its request: slot %d keeps nothing of it",
                     session.id, slot)
            self.executor.mark_unproven(slot)
            return
        self.executor.witness[slot] = self.client.witness()
        # What the slot now holds: compared with /slots before the next swap.
        held = plan.held_by_timings(timings) if timings else self._held_after_cut(slot)
        used_at = now_iso()
        self.pool.note_use(slot, used_at)  # this process keeps it exactly, in memory
        now = time.monotonic()
        since = now - self._used_at_written.get(slot, -plan.USED_AT_RESOLUTION_S)
        swapped = slot in self.executor.unrecorded
        state = self.executor.recorded(slot, self.table.get(slot))
        self.executor.unrecorded.pop(slot, None)
        done = plan.after_answer(state, session, lease.cache, held,
                                 bool(timings), used_at, len(self.slot_ids()) > 1, since)
        if done.state is not None or swapped:
            self.table.put(slot, done.state or state)  # the swap's record, if any, with it
            self._used_at_written[slot] = now
        if done.verify_restore:
            self._verify_restore(lease, cache_n)
        # The restore's own bookkeeping, written now rather than on the swap's critical path.
        restored = lease.restore_note()
        own = bool(restored) and lease.restored_stem == session.stem
        if restored and not own:
            self.store.update_sidecar(lease.restored_stem, {}, count="restores",
                                      of_save=lease.restored_saved_at, **restored)
        if done.count_hit:
            self.store.update_sidecar(session.stem, {"session_id": session.id, "kind": "session"},
                                      count=("hits", "restores") if own else "hits",
                                      session_id=session.id,
                                      last_used_at=now_iso(), last_cache=lease.cache,
                                      last_cache_n=cache_n, last_prompt_n=prompt_n,
                                      **({"trail": session.trail} if session.trail else {}),
                                      **({k: v for k, v in restored.items()
                                          if k != "last_used_at"} if own else {}))

    def _held_after_cut(self, slot: int) -> int:
        """An answer that ended without timings (cut short at shutdown, client gone): ask
        ``/slots`` what the slot holds now, while the lock still keeps everyone else out, so
        the next swap or the save at shutdown can still prove the slot is this session's.
        0 when it cannot tell."""
        try:
            entry = self.executor.slot_entry(slot)
        except (UpstreamError, UpstreamUnavailable):
            return 0  # llama-server gone: the next swap finds the slot empty or unknown
        return int(entry.get("n_prompt_tokens") or 0) if entry and "id_task" in entry else 0

    def _verify_restore(self, lease: Lease, cache_n: int) -> None:
        """Count restores that llama-server reported but did not use (see restore_check), for
        the llama-server the swap found (every lease that restored carries it)."""
        key = fingerprint_key(lease.made_by)
        if verify_restore(self.restore_check, self.store, lease, cache_n, key) == "not_honoured":
            metrics.RESTORE_MISSES.labels("not_honoured").inc()


def slot_row(slot: int, state: SlotState, busy: bool, busy_since: str | None,
             n_ctx: int | None) -> dict:
    """One slot's row: the session it holds, its tokens, busy or idle and since when."""
    return {"id": slot, "session_id": state.session_id or DEFAULT_SESSION,
            "persistent": state.persistent,
            "file": f"{state.stem}.bin" if state.stem else None,
            "tokens": state.tokens, "n_ctx": n_ctx,
            "busy": busy, "busy_since": busy_since,
            "unproven": state.phase.value in ("claimed", "unproven"),
            "since": state.updated_at, "last_used_at": state.used_at}
