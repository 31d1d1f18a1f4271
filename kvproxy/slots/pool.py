"""Leasing one of llama-server's slots: a lock per slot, a first-come-first-served queue.

Each slot has its own ``SlotLock`` (thread lock plus file lock), so processes
sharing the slot folder exclude each other slot by slot. Where a request goes
is decided by ``placement.place`` over the state table; this module only
takes the slot it names. A slot is taken with a try-lock: when another process
got there first, the slot counts as busy for a moment and the decision is made
again, so the choice stays honest across processes without waiting on a slot
that may stay busy for minutes.

Requests of this process that cannot be placed wait in arrival order (bounded
in time and in number, as before with one slot); every release wakes them,
and they look again every ``POLL`` seconds for slots freed by other processes.
One exception (``queue.join``): a returning conversation, whose turn is a restore and
its few new tokens, goes before new ones that wait for a whole prefill, unless they were
overtaken ``MAX_OVERTAKEN`` times already; so a chat in progress is not held up for minutes
behind other users' long first prompts, and a new one waits at most that many short turns
longer than in arrival order. With several slots, one keeps taking new conversations
(``queue.serving_order``), so their prefills go on while the other slots serve returning turns.
A slot given back by a conversation while new conversations wait is kept for its next turn
``keep`` seconds (``give_back``): they leave it alone meanwhile (``placement``), so a chat whose
user or tool answers at once is not put behind another conversation's whole prefill. At most
all but one of several slots are kept, so new conversations keep moving and the machine does
not idle through every user's pause; each time the kept conversation comes back while they
wait counts as overtaking them (unless a slot serves new conversations), so the same bound
holds.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, NamedTuple

from kvproxy.telemetry import metrics
from kvproxy.slots.placement import facts_from_table, queue_order
from kvproxy.slots.queue import (MAX_OVERTAKEN, Kept, Waiter, join, keep_on_give_back,  # noqa: F401
                                 keeps_needed, live_keeps, overtaken_by_take, serving_order)
from kvproxy.slots.lock import SlotBusy, SlotLock
from kvproxy.slots.state import SlotTable
from kvproxy.storage.store import SessionStore

POLL = 0.1  # seconds between looks at slots other processes may have freed


class Taken(NamedTuple):
    slot: int
    waited: bool
    placed: str  # placement's reason: HOLDER, FREE or EVICT


def queue_position(queue: list[Waiter], short: bool, counts: bool = True) -> int:
    """Where a new waiter joins ``queue`` (``queue.join``); the waiters it passes count one
    more overtaking."""
    joined = join(queue, short, counts)
    for passed in joined.passed:
        passed.overtaken += 1
    return joined.index


class SlotPool:
    """The slots of one llama-server, leased one request at a time each."""

    def __init__(self, store: SessionStore, timeout: float, max_waiters: int,
                 keep: float = 0.0):
        self.store = store
        self.keep = keep  # seconds a slot is kept for the conversation that gave it back
        self.table = SlotTable(store)
        self.timeout = timeout
        self.max_waiters = max_waiters
        self._cond = threading.Condition()
        self._queue: list[Waiter] = []
        self._locks: dict[int, SlotLock] = {}
        self._elsewhere: dict[int, float] = {}  # slot -> until when another process holds it
        self.waiting = 0  # requests of this process waiting for a slot now
        self.used_here: dict[int, str] = {}  # slot -> ISO time this process last used it
        self._kept: dict[int, Kept] = {}  # slot -> the conversation it is kept for, until when
        self._max_kept = 1  # slots kept at once: all but one of the slots taken from (take)
        self._saving: set[int] = set()  # slots held by a background save (hold_for_save)
        self._new_in: set[int] = set()  # slots leased to a new conversation that waited

    def lock(self, slot: int) -> SlotLock:
        with self._cond:
            if slot not in self._locks:
                self._locks[slot] = SlotLock(self.store.slot_lock_path(slot), self.timeout,
                                             self.max_waiters)
            return self._locks[slot]

    def busy_here(self) -> set[int]:
        """Slots a thread of this process holds now."""
        with self._cond:
            return {slot for slot, lock in self._locks.items() if lock.held_here()}

    def _busy(self) -> set[int]:
        now = time.monotonic()
        elsewhere = {slot for slot, until in self._elsewhere.items() if until > now}
        return {slot for slot, lock in self._locks.items() if lock.held_here()} | elsewhere

    def take(self, slot_ids: list[int], key: str | None, side: bool,
             timeout: float | None = None,
             short: Callable[[], bool] | None = None) -> "Taken":
        """Lease the slot ``placement`` picks for ``key``; wait (bounded) when none can be
        had, in arrival order but for requests that ``short`` says are short, asked only
        once the request has to wait (``queue_position``). Returns the slot, whether the
        request waited and why that slot. Raises ``SlotBusy`` (bound reached, queue full) or
        ``SlotUnavailable`` (the lock cannot be taken at all)."""
        bound = self.timeout if timeout is None else timeout
        started = time.monotonic()
        me = Waiter(key, side, deadline=started + bound)
        counted = waited = False
        with self._cond:
            self._max_kept = max(1, len(slot_ids) - 1)
            self._queue.append(me)
        try:
            while True:
                # One slot: nothing to choose between, so the table is not read (the
                # no-swap path stays as fast as it was).
                table = self.table.read() if len(slot_ids) > 1 else {}
                with self._cond:
                    facts = facts_from_table(table, slot_ids, self._busy(), self.used_here,
                                             self._kept_now(), self._saving)
                    keep_until = time.monotonic() + self.keep
                    order = serving_order(self._queue, len(slot_ids) > 1, bool(self._new_in))
                    decision = queue_order(facts, [(w.key, w.side, w.honours_keeps(keep_until))
                                                   for w in order], order.index(me))
                if decision.slot is not None:
                    lock = self.lock(decision.slot)
                    if lock.try_acquire():
                        metrics.LOCK_WAIT.observe(time.monotonic() - started)
                        self._took(decision.slot, me, waited)
                        return Taken(decision.slot, waited, decision.action)
                    if not lock.held_here():  # another process holds it: look elsewhere
                        with self._cond:
                            self._elsewhere[decision.slot] = time.monotonic() + POLL
                    continue
                if not counted:
                    moves_up = short is not None and short()
                    with self._cond:
                        if self.waiting >= self.max_waiters:
                            metrics.REJECTED.labels("queue_full").inc()
                            raise SlotBusy(0, retry_after=self._retry_after(bound), queue_full=True)
                        self.waiting += 1
                        metrics.WAITERS.inc()
                        if moves_up:
                            self._queue.remove(me)
                            me.short = True
                            self._queue.insert(queue_position(self._queue, True,
                                                              counts=not self._new_in), me)
                    counted = waited = True
                    if moves_up:
                        continue  # a returning conversation may take a kept slot: look again
                remaining = bound - (time.monotonic() - started)
                if remaining <= 0:
                    metrics.REJECTED.labels("timeout").inc()
                    raise SlotBusy(time.monotonic() - started, retry_after=self._retry_after(bound))
                with self._cond:
                    self._cond.wait(min(remaining, POLL))
        finally:
            with self._cond:
                self._queue.remove(me)
                if not keeps_needed(self._queue):
                    self._kept.clear()  # nobody left to keep the slots from
                if counted:
                    self.waiting -= 1
                    metrics.WAITERS.dec()
                self._cond.notify_all()

    def hold_for_save(self, slot: int) -> bool:
        """Take ``slot`` for a background save if it is free now; placement waits for it
        rather than evict another slot's unsaved session (``give_back`` ends it)."""
        if not self.lock(slot).try_acquire():
            return False
        with self._cond:
            self._saving.add(slot)
        return True

    def note_use(self, slot: int, at: str) -> None:
        """Remember when this process last used ``slot``, for least-recently-used placement."""
        with self._cond:
            self.used_here[slot] = max(at, self.used_here.get(slot, ""))

    def give_back(self, slot: int, keep_for: str | None = None) -> None:
        """Free a leased slot and wake the requests waiting for one; ``keep_for``: the session
        key of a conversation whose next turn the slot is kept for (``keep`` seconds) when new
        conversations are waiting for a slot (with none waiting, there is nothing to keep it
        from, and one that comes later takes it at once)."""
        try:
            self.lock(slot).release()
        finally:
            with self._cond:
                self._elsewhere.pop(slot, None)
                self._saving.discard(slot)
                self._new_in.discard(slot)
                kept = keep_on_give_back(keep_for, self.keep, time.monotonic(), self._kept,
                                         self._max_kept, self._queue)
                if kept is not None:
                    self._kept[slot] = kept
                self._cond.notify_all()

    def _kept_now(self) -> dict[int, str]:
        """Slots kept for a session's next turn, and for which session (caller holds _cond)."""
        self._kept = live_keeps(self._kept, time.monotonic())
        return {slot: kept.key for slot, kept in self._kept.items()}

    def _took(self, slot: int, taker: Waiter, waited: bool) -> None:
        """``slot`` was taken: its keep ends, and the waiters the take overtook count it
        (``queue.overtaken_by_take``). Taken by a new conversation that waited, the slot now
        serves new ones."""
        with self._cond:
            kept = self._kept.pop(slot, None)
            for waiter in overtaken_by_take(taker, kept, bool(self._new_in), self._queue):
                waiter.overtaken += 1
            if waited and taker.new():
                self._new_in.add(slot)

    @staticmethod
    def _retry_after(bound: float) -> int:
        return max(1, int(min(bound, 30)))
