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
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import quote
from typing import Any, Callable, Iterator

from kvproxy.storage import disk
from kvproxy.ops import metrics
from kvproxy.sessions.identity import DEFAULT_SESSION, Session, file_stem
from kvproxy.ops.activity import RecentActivity
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable
from kvproxy.slots.plan import (EMPTY, FOREIGN, OURS, UNKNOWN, fingerprint, fingerprint_key, judge_slot,
                   plan_swap)
from kvproxy.slots.restore_check import RestoreCheck, verify_restore
from kvproxy.slots.lock import ClientGone, SlotBusy, SlotLock, SlotUnavailable
from kvproxy.slots.pool import SlotPool
from kvproxy.storage.store import SessionStore, StorageError, now_iso

USED_AT_RESOLUTION_S = 1.0
log = logging.getLogger("kvproxy.switch")

from kvproxy.slots.slotfiles import (BASE, HIT, MIN_BASE_TOKENS, MISS, RESTORED, PromptView,  # noqa: F401
                        SlotFiles, incoming_stems)

__all__ = ["SlotSwitch", "Lease", "SlotBusy", "SlotUnavailable", "ClientGone", "HIT", "RESTORED",
           "BASE", "MISS", "header_safe", "judge_slot", "fingerprint", "fingerprint_key", "OURS", "EMPTY", "FOREIGN", "UNKNOWN"]


@dataclass
class Lease:
    """The slot, held for one request."""

    session: Session
    cache: str
    restored_tokens: int = 0
    swap_ms: float = 0.0
    restored_stem: str | None = None
    made_by: dict | None = None  # what llama-server runs, when the swap asked
    prompt: PromptView | None = field(default=None, repr=False)  # for the restore check
    slot: int = 0                      # the llama-server slot it runs in (pin with id_slot)
    leased_at: float = 0.0             # monotonic time the slot was taken
    _release: Any = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        return {"X-KVProxy-Session": header_safe(self.session.id), "X-KVProxy-Cache": self.cache}


def header_safe(text: str) -> str:
    """An id as an HTTP header value: printable ASCII as is, anything else percent-encoded,
    so a hostile id from a request body can neither break nor inject response headers."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text
    # backslashreplace: a lone surrogate cannot be UTF-8 encoded and must not raise here.
    return quote(text.encode("utf-8", "backslashreplace"), safe="")


class HeldElsewhere(Exception):
    """Another process put the session in another slot since the placement looked."""


class SlotSwitch(SlotFiles):
    """Leases llama-server's slots to requests and swaps each to its request's session.

    With one slot it behaves as kvproxy always did. With several, ``SlotPool``
    picks the slot (``placement``): the one holding the session, else an idle
    one, saving its session first when it holds one.
    """

    def __init__(self, client: LlamaClient, store: SessionStore, slot_id: int = 0,
                 lock_timeout: float = 300, base_snapshots: bool = True,
                 restore_miss_limit: int = 2, max_disk_bytes: int = 0, min_free_bytes: int = 0,
                 max_waiters: int = 32, restore_off_minutes: float = 60, slots: int = 1):
        self.client = client
        self.store = store
        store.legacy_slot = slot_id
        self.activity = RecentActivity()  # recent swaps and outcomes, for /status and the CLI
        self.slot_id = slot_id            # the slot a single-slot kvproxy drives
        self.configured_slots = slots     # 0: as many as llama-server has
        self._slot_ids: list[int] | None = [slot_id] if slots == 1 else (
            list(range(slots)) if slots > 1 else None)
        self.base_snapshots = base_snapshots
        self.max_disk_bytes = max_disk_bytes
        self.lock_timeout = lock_timeout
        self.budget = disk.DiskBudget(store, max_disk_bytes, min_free_bytes)
        self.pool = SlotPool(store, lock_timeout, max_waiters)
        self.restore_check = RestoreCheck(store.root, restore_miss_limit, restore_off_minutes)
        # Slots whose swap failed half-way: until their next good swap, they are not trusted.
        self._uncertain: set[int] = set()
        self._n_ctx: dict[int, int] = {}  # per slot, from /slots
        self._busy_since: dict[int, str] = {}
        # Per slot: a connection to llama-server that existed when kvproxy last recorded what
        # the slot holds. Still open: llama-server did not restart since (see slot_view).
        self._witness: dict[int, Any] = {}
        # Per slot: when this process last wrote its used_at (see _after_request).
        self._used_at_written: dict[int, float] = {}

    # -- the slots ---------------------------------------------------------
    def slot_ids(self) -> list[int]:
        """The slots kvproxy drives: ``KVPROXY_SLOTS``, else as many as llama-server reports
        (asked once it answers; until then the one slot ``KVPROXY_SLOT_ID``)."""
        if self._slot_ids is None:
            total = self._llama_slot_count()
            if total is None:
                return [self.slot_id]
            self._slot_ids = [self.slot_id] if total == 1 else list(range(total))
            log.info("driving %d llama-server slot(s): %s", len(self._slot_ids), self._slot_ids)
        return self._slot_ids

    def _llama_slot_count(self) -> int | None:
        try:
            total = self.client.props().get("total_slots")
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

    @property
    def _thread_lock(self):
        return self.lock.thread_lock

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
        while True:
            slot, waited = self.pool.take(self.slot_ids(), session.key, not session.persistent,
                                          timeout=max(0.0, deadline - time.monotonic()))
            waited = waited or waited_before
            taken_at = time.monotonic()
            try:
                if waited and still_wanted is not None and not still_wanted():
                    metrics.REJECTED.labels("client_gone").inc()
                    log.info("client of session %s left while waiting for the slot: no swap",
                             session.id)
                    raise ClientGone()
                lease = self._swap_to(session, prompt, slot)
            except HeldElsewhere:
                self.pool.give_back(slot)
                waited_before = True
                continue
            except BaseException as exc:
                if isinstance(exc, ClientGone):
                    self.pool.give_back(slot)
                    raise
                self.mark_unknown(slot)
                self.pool.give_back(slot)
                if isinstance(exc, (UpstreamError, UpstreamUnavailable, SlotUnavailable,
                                    StorageError)) or not isinstance(exc, Exception):
                    raise
                log.exception("swapping slot %d to session %s failed", slot, session.id)
                raise SlotUnavailable(f"the slot could not be prepared ({exc.__class__.__name__}); "
                                      "see kvproxy's log") from exc
            self._busy_since[slot] = now_iso()
            lease.leased_at = taken_at
            lease._release = lambda: self.pool.give_back(slot)
            return lease

    def mark_unknown(self, slot: int) -> None:
        """After a failed swap: trust nothing the slot holds until its next good swap.

        Kept in memory and, when the disk allows, in the state file, so another
        process sharing the folder does not trust the slot either.
        """
        self._uncertain.add(slot)
        try:
            self.store.change_table(lambda table: table.setdefault(slot, {}).update(
                slot_unknown=True))
        except Exception:  # noqa: BLE001 - the disk may be why the swap failed
            log.warning("could not mark slot %d as unknown in the state file", slot)

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
        table = self.store.read_table()
        return [slot_row(slot, table.get(slot) or {}, self.busy(slot), self.busy_since(slot),
                         self._n_ctx.get(slot)) for slot in self.slot_ids()]

    def current_made_by(self) -> dict:
        return fingerprint(self.client.props(), self.client.models())

    def _swap_to(self, session: Session, prompt: PromptView | None, slot: int) -> Lease:
        state = self.store.read_state(slot)
        keep = state.get("active_key") == session.key
        view = self.slot_view(state, slot, trust_connection=keep)
        plan = plan_swap(state, session.key, view)
        if plan.hit:
            metrics.SWAPS.labels("none").inc()
            metrics.SLOT_SWAPS.labels(str(slot), "none").inc()
            return Lease(session, HIT, slot=slot)  # a hit needs no restore check: no prompt
        started = time.monotonic()
        made_by = self.current_made_by()
        if plan.save_active:
            metrics.SLOT_SWAPS.labels(str(slot), "save").inc()
            self.save_held(slot, state, made_by, keep=incoming_stems(session))
        elif plan.keep_file:
            log.info("not saving session %s: slot %d is %s (kvproxy cannot prove it "
                     "holds that session); its file stays as it was", state["active"], slot, view)
        self._claim(slot, session)  # the slot is marked unknown until the swap is done
        restoring_off = self.restore_check.restoring_off(fingerprint_key(made_by))
        cache, restored, restored_stem = self._load(session, made_by, restoring_off, prompt, slot)
        metrics.SLOT_SWAPS.labels(str(slot), cache).inc()
        self.store.write_state({"active": session.id, "active_key": session.key,
                                "active_stem": session.stem,
                                "active_persistent": session.persistent,
                                "active_system_hash": session.system_hash,
                                "slot_tokens": restored, "slot_unknown": False,
                                "unsaved": False,  # restored from its file, or a new session
                                "updated_at": now_iso(), "used_at": now_iso()}, slot)
        self._uncertain.discard(slot)
        self._witness[slot] = self.client.witness()
        swap_ms = (time.monotonic() - started) * 1000
        log.info("swap to session=%s source=%s cache=%s slot=%s restored_tokens=%d swap_ms=%.1f "
                 "id_slot=%d", session.id, session.source, cache, view, restored, swap_ms, slot)
        return Lease(session, cache, restored, swap_ms, restored_stem, made_by, prompt, slot=slot)

    def _claim(self, slot: int, session: Session) -> None:
        """Name ``session`` as what ``slot`` is being filled with, unproven until the swap is
        done. Checked and written in one step of the table, so two processes never put one
        session in two slots; raises ``HeldElsewhere`` when another slot holds it already."""
        def claim(table: dict[int, dict]) -> int | None:
            if session.persistent:
                for other, entry in table.items():
                    if other != slot and other in self.slot_ids() and entry.get("active") \
                            and entry.get("active_key") == session.key:
                        return other
            table[slot] = {"active": session.id, "active_key": session.key,
                           "active_stem": session.stem, "active_persistent": session.persistent,
                           "active_system_hash": session.system_hash, "slot_tokens": 0,
                           "slot_unknown": True, "updated_at": now_iso(), "used_at": now_iso()}
            return None
        other = self.store.change_table(claim)
        if other is not None:
            log.info("session %s is in slot %d already (another process put it there): "
                     "going there instead of slot %d", session.id, other, slot)
            raise HeldElsewhere()

    def slot_view(self, state: dict, slot: int, trust_connection: bool = False) -> str:
        """Whether the slot holds what kvproxy's last action left in it (``OURS``), or not.

        With ``trust_connection``, a connection still open since the last slot
        call counts as proof that llama-server did not restart, and ``/slots``
        is not asked. Only the no-swap path trusts it: it cannot see a client
        that talked to llama-server directly, but the worst outcome there is one
        prefill (llama-server answers from what it holds either way). A swap
        always asks: an uncertain slot must never be saved over a session's file.
        """
        if slot in self._uncertain or state.get("slot_unknown"):
            return UNKNOWN
        expected = int(state.get("slot_tokens") or 0)
        if trust_connection and expected > 0 and self.client.still_open(self._witness.get(slot)):
            return OURS
        try:
            entry = self._slot_entry(slot)
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("GET /slots failed (%s): slot %d is treated as foreign", exc, slot)
            return UNKNOWN
        return judge_slot(entry, expected)

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
                    self._erase(one)
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

    def checkpoint(self, timeout: float = 10) -> bool:
        """Save the session of every slot now (at shutdown), so a later llama-server restart
        loses nothing. True when at least one session was saved."""
        deadline = time.monotonic() + timeout
        saved = [self._checkpoint_slot(slot, max(0.0, deadline - time.monotonic()))
                 for slot in self.slot_ids()]
        return any(saved)

    def _checkpoint_slot(self, slot: int, timeout: float) -> bool:
        try:
            self.pool.lock(slot).acquire(timeout)
        except SlotUnavailable:
            log.warning("slot %d stayed busy: its session was not saved at shutdown", slot)
            return False
        try:
            state = self.store.read_state(slot)
            if not (state.get("active_persistent") and state.get("active")) \
                    or self.slot_view(state, slot) != OURS:
                return False
            return self.save_held(slot, state, self.current_made_by()) is not None
        except (UpstreamError, UpstreamUnavailable, StorageError) as exc:
            log.warning("could not save the active session of slot %d at shutdown: %s", slot, exc)
            return False
        finally:
            self.pool.give_back(slot)

    def forget(self, session_id: str) -> bool:
        """Delete a session's (or base snapshot's) files; erase every slot that holds it.

        With llama-server down the files still go: the slot is then marked
        unknown, so what it holds is never saved or trusted again.
        """
        stems = {s["stem"] for s in self.store.sidecars() if s.get("session_id") == session_id}
        stems.add(file_stem(session_id))  # a file left without its sidecar
        holders = [slot for slot, entry in self.store.read_table().items()
                   if entry.get("active") == session_id and slot in self.slot_ids()]
        taken = []
        try:
            for slot in holders:
                self.pool.lock(slot).acquire()
                taken.append(slot)
                state = self.store.read_state(slot)
                if state.get("active") != session_id:
                    continue
                try:
                    self._erase(slot)
                except (UpstreamError, UpstreamUnavailable) as exc:
                    log.warning("could not erase slot %d of deleted session %s: %s",
                                slot, session_id, exc)
                    self._uncertain.add(slot)
                self.store.write_state({**state, "active": DEFAULT_SESSION, "active_key": None,
                                        "active_stem": None,
                                        "active_persistent": False, "active_system_hash": None,
                                        "slot_tokens": 0, "slot_unknown": slot in self._uncertain,
                                        "updated_at": now_iso()}, slot)
            removed = [self.store.delete(stem) for stem in stems]
            return any(removed)
        finally:
            for slot in reversed(taken):
                self.pool.give_back(slot)

    # -- after the request -------------------------------------------------
    def _after_request(self, lease: Lease, timings: dict) -> None:
        session = lease.session
        cache_n = int(timings.get("cache_n") or 0)
        prompt_n = int(timings.get("prompt_n") or 0)
        predicted_n = int(timings.get("predicted_n") or 0)
        metrics.TOKENS.labels("reused").inc(cache_n)
        metrics.TOKENS.labels("computed").inc(prompt_n)
        self.activity.record(lease, timings)
        slot = lease.slot
        self._witness[slot] = self.client.witness()
        if timings:  # what the slot now holds: compared with /slots before the next swap
            held = cache_n + prompt_n + predicted_n
        else:
            held = self._held_after_cut(slot)
        state = self.store.read_state(slot)
        changes = {"slot_tokens": held} if held and state.get("slot_tokens") != held else {}
        if session.persistent and not state.get("unsaved"):
            changes["unsaved"] = True  # turns its file lacks: saved before an unpinned side task
        # used_at orders slots for eviction, so it matters only with several slots. This
        # process keeps it exactly in memory; the table (for other processes) gets it at most
        # once a second when nothing else changed, so a no-swap request writes no more with
        # several slots than with one.
        used_at = now_iso()
        self.pool.note_use(slot, used_at)
        now = time.monotonic()
        used_at_due = len(self.slot_ids()) > 1 and \
            now - self._used_at_written.get(slot, -USED_AT_RESOLUTION_S) >= USED_AT_RESOLUTION_S
        if changes or used_at_due:
            self.store.change_table(lambda table: table.setdefault(slot, {}).update(
                used_at=used_at, **changes))
            self._used_at_written[slot] = now
        if lease.cache in (RESTORED, BASE) and timings:
            self._verify_restore(lease, cache_n)
        if not session.persistent:
            return
        self.store.update_sidecar(session.stem, {"session_id": session.id, "kind": "session"},
                                  count="hits", session_id=session.id, last_used_at=now_iso(),
                                  last_cache=lease.cache, last_cache_n=cache_n,
                                  last_prompt_n=prompt_n)

    def _held_after_cut(self, slot: int) -> int:
        """An answer that ended without timings (cut short at shutdown, client gone): ask
        ``/slots`` what the slot holds now, while the lock still keeps everyone else out, so
        the next swap or the save at shutdown can still prove the slot is this session's.
        0 when it cannot tell."""
        try:
            entry = self._slot_entry(slot)
        except (UpstreamError, UpstreamUnavailable):
            return 0  # llama-server gone: the next swap finds the slot empty or unknown
        return int(entry.get("n_prompt_tokens") or 0) if entry and "id_task" in entry else 0

    def _verify_restore(self, lease: Lease, cache_n: int) -> None:
        """Count restores that llama-server reported but did not use (see restore_check), for
        the llama-server the swap found (every lease that restored carries it)."""
        key = fingerprint_key(lease.made_by)
        if verify_restore(self.restore_check, self.store, lease, cache_n, key) == "not_honoured":
            metrics.RESTORE_MISSES.labels("not_honoured").inc()


def slot_row(slot: int, entry: dict, busy: bool, busy_since: str | None,
             n_ctx: int | None) -> dict:
    """One slot's row: the session it holds, its tokens, busy or idle and since when."""
    stem = entry.get("active_stem")
    return {"id": slot, "session_id": entry.get("active") or DEFAULT_SESSION,
            "persistent": bool(entry.get("active_persistent")),
            "file": f"{stem}.bin" if stem else None,
            "tokens": int(entry.get("slot_tokens") or 0), "n_ctx": n_ctx,
            "busy": busy, "busy_since": busy_since,
            "unproven": bool(entry.get("slot_unknown")),
            "since": entry.get("updated_at"), "last_used_at": entry.get("used_at")}
