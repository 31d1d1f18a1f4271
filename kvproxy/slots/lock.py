"""The lock around one slot: a thread lock plus a file lock, bounded in time and in waiters.

The thread lock orders this process's threads; the ``filelock`` lock in the
slot folder orders processes that share the folder. Waiting is bounded twice:
by time (``KVPROXY_LOCK_TIMEOUT``) and by the number of threads already
waiting (``KVPROXY_MAX_WAITERS``), so a crowd of clients cannot take every
server thread and /health, /metrics and the admin API keep answering.
Any failure to take the file lock (read-only or full disk, a filesystem
without locks) is a ``SlotUnavailable``, and leaves the thread lock free.

Taking and freeing the file lock cost a no-swap request about a fifth of a millisecond, so
a slot freed by this process keeps its file lock while this process keeps using it: a
request of this process that takes the slot again takes only the thread lock. The file lock
is let go once it has gone ``LINGER_S`` seconds unused, and whenever another process
asks for it: a process that finds the file lock taken leaves a marker beside it
(``<lock>.asked``, left again at each of its looks: ``pool.POLL``, or every ``TICK_S``
while a blocking ``acquire`` waits), and for ``ASKED_S`` seconds after the last ask the
holder frees the file lock at every release, or within ``TICK_S`` when it is not using
the slot. So under steady use by this process another
process finds the slot free between two requests as often as it did before the file lock
was kept, and an idle holder keeps it waiting at most ``TICK_S`` longer.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import filelock

from kvproxy.errors import ClientGone, SlotBusy, SlotUnavailable  # noqa: F401 - imported from here too
from kvproxy.telemetry import metrics

log = logging.getLogger("kvproxy.switch")

LINGER_S = 0.5   # seconds a freed slot keeps its file lock for this process's next request
TICK_S = 0.1     # seconds between two looks of the releaser at the lingering file locks
ASKED_S = 1.0    # seconds after another process's last ask during which no file lock lingers


class SlotLock:
    """Mutual exclusion on the slot across threads and processes."""

    def __init__(self, lock_path: Path, timeout: float, max_waiters: int):
        self.path = lock_path
        self.asked_path = Path(f"{lock_path}.asked")  # another process wants the file lock
        self.timeout = timeout
        self.max_waiters = max_waiters
        self.thread_lock = threading.Lock()
        self._file_lock = filelock.FileLock(str(lock_path), thread_local=False)
        self._count_lock = threading.Lock()
        self.waiting = 0
        # Whether this process holds the file lock, and since when nobody uses it; both
        # change only under ``_file_guard``, taken after the thread lock.
        self._file_guard = threading.Lock()
        self._file_held = False
        self.freed_at = 0.0
        self._asked_until = 0.0   # another process asked lately: the file lock lingers not

    def acquire(self, timeout: float | None = None) -> bool:
        """Take the slot within ``timeout`` (default: the configured bound).

        Returns whether the caller had to wait for another request.
        Raises ``SlotBusy`` (bound reached, queue full) or ``SlotUnavailable``.
        """
        bound = self.timeout if timeout is None else timeout
        started = time.monotonic()
        waited = not self.thread_lock.acquire(blocking=False)
        if waited:
            self._wait_for_thread_lock(started, bound)
        try:
            elsewhere = self._hold_file_lock(started, bound)
        except filelock.Timeout:
            raise self._busy(started, bound) from None
        metrics.LOCK_WAIT.observe(time.monotonic() - started)
        return waited or elsewhere

    def try_acquire(self) -> bool:
        """Take the slot only if nobody (thread or process) holds it; never waits.
        Raises ``SlotUnavailable`` when the file lock cannot be taken at all."""
        if not self.thread_lock.acquire(blocking=False):
            return False
        try:
            self._hold_file_lock()
        except filelock.Timeout:
            return False
        return True

    def _hold_file_lock(self, started: float = 0.0, bound: float | None = None) -> bool:
        """With the thread lock just taken, hold the file lock too: kept from an earlier
        release, or taken now. When another process holds it: with a ``bound``, wait for it
        until then; without, ask for it (``filelock.Timeout``). Whether it waited; any
        failure frees the thread lock."""
        try:
            with self._file_guard:
                waited = False
                if not self._file_held:
                    try:
                        self._file_lock.acquire(timeout=0)
                    except filelock.Timeout:
                        if bound is None:
                            self._ask_for_file_lock()
                            raise
                        waited = True
                        self._wait_for_file_lock(started, bound)
                    self._file_held = True
                return waited
        except filelock.Timeout:
            self.thread_lock.release()
            raise
        except Exception as exc:  # noqa: BLE001 - read-only, full, lockless filesystems...
            self.thread_lock.release()
            raise _lock_unusable(exc) from exc
        except BaseException:
            self.thread_lock.release()
            raise

    def held_here(self) -> bool:
        """Whether a thread of this process holds the slot."""
        return self.thread_lock.locked()

    def _wait_for_thread_lock(self, started: float, bound: float) -> None:
        with self._count_lock:
            if self.waiting >= self.max_waiters:
                metrics.REJECTED.labels("queue_full").inc()
                raise SlotBusy(0, retry_after=self._retry_after(bound), queue_full=True)
            self.waiting += 1
            metrics.WAITERS.inc()
        try:
            got = self.thread_lock.acquire(timeout=bound)
        finally:
            with self._count_lock:
                self.waiting -= 1
                metrics.WAITERS.dec()
        if not got:
            raise self._busy(started, bound)

    def _retry_after(self, bound: float) -> int:
        return max(1, int(min(bound, 30)))

    def _busy(self, started: float, bound: float) -> SlotBusy:
        metrics.REJECTED.labels("timeout").inc()
        return SlotBusy(time.monotonic() - started, retry_after=self._retry_after(bound))

    def _wait_for_file_lock(self, started: float, bound: float) -> None:
        """Wait for another process's file lock until ``bound``, asking for it every
        ``TICK_S`` as the pool's waiters do at each look (``filelock.Timeout`` at the bound)."""
        while True:
            self._ask_for_file_lock()
            remaining = bound - (time.monotonic() - started)
            try:
                self._file_lock.acquire(timeout=max(0.0, min(remaining, TICK_S)))
                return
            except filelock.Timeout:
                if remaining <= TICK_S:
                    raise

    def _ask_for_file_lock(self) -> None:
        """Tell the process holding the file lock that this one wants it (``asked_path``)."""
        try:
            os.close(os.open(self.asked_path, os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError:  # a folder that cannot take the marker: the holder lets go on idling
            pass

    def _asked_for(self) -> bool:
        """Whether another process asked for the file lock in the last ``ASKED_S`` seconds
        (each ask is taken in: its marker removed). While it waits it asks at each look,
        so the lock is let go at every release until it got in."""
        now = time.monotonic()
        try:
            os.unlink(self.asked_path)
            self._asked_until = now + ASKED_S
        except FileNotFoundError:
            pass
        except OSError:   # a marker that cannot be removed still asks
            self._asked_until = now + ASKED_S
        return now < self._asked_until

    def release(self) -> None:
        """Free the slot: the thread lock now, the file lock now when another process asked
        for it, else once it lingered ``LINGER_S`` seconds unused (``free_file_lock``)."""
        try:
            with self._file_guard:
                self.freed_at = time.monotonic()
                if self._file_held and self._asked_for():
                    self._file_held = False
                    self._file_lock.release()
        finally:
            self.thread_lock.release()
        if self._file_held:
            _releaser.linger(self)

    def free_file_lock(self, idle: float = LINGER_S) -> bool:
        """Free the file lock if no thread of this process has used the slot for ``idle``
        seconds or another process asked for it; True when it is free (or was not held).
        Never waits: a request waiting for another process's file lock holds the guard,
        and the other slots' lingering locks must not wait for it."""
        if not self._file_guard.acquire(blocking=False):
            return False
        try:
            if not self._file_held:
                return True
            if self.thread_lock.locked() or (time.monotonic() - self.freed_at < idle
                                             and not self._asked_for()):
                return False
            self._file_held = False
            self._file_lock.release()
            return True
        finally:
            self._file_guard.release()


class _Releaser:
    """The one thread that frees the file locks that lingered ``LINGER_S`` seconds unused
    or that another process asked for; it sleeps while none lingers."""

    def __init__(self) -> None:
        self._lingering: set[SlotLock] = set()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def linger(self, lock: SlotLock) -> None:
        """Free ``lock``'s file lock once it has lingered. Waking the thread costs the
        request a thread switch: only a lock not lingering yet wakes it."""
        with self._changed:
            if lock in self._lingering:
                return
            self._lingering.add(lock)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvproxy-slot-locks",
                                                daemon=True)
                self._thread.start()
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._lingering:
                    self._changed.wait()
                lingering = list(self._lingering)
            for lock in lingering:
                try:
                    freed = lock.free_file_lock()
                except Exception:  # the process's exit frees it at the latest
                    log.exception("freeing the file lock %s failed", lock.path)
                    freed = True
                if freed:
                    with self._changed:
                        self._lingering.discard(lock)
            time.sleep(TICK_S)


_releaser = _Releaser()


def _lock_unusable(exc: Exception) -> SlotUnavailable:
    """A lock error that is not a timeout: the folder, not a holder, is the problem."""
    return SlotUnavailable(f"the slot lock cannot be taken ({exc.__class__.__name__}: {exc}); "
                           "check that the slot folder is writable")
