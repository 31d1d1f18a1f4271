"""The lock around one slot: a thread lock plus a file lock, bounded in time and in waiters.

The thread lock orders this process's threads; the ``filelock`` lock in the
slot folder orders processes that share the folder. Waiting is bounded twice:
by time (``KVPROXY_LOCK_TIMEOUT``) and by the number of threads already
waiting (``KVPROXY_MAX_WAITERS``), so a crowd of clients cannot take every
server thread and /health, /metrics and the admin API keep answering.
Any failure to take the file lock (read-only or full disk, a filesystem
without locks) is a ``SlotUnavailable``, and leaves the thread lock free.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import filelock

from kvproxy.errors import ClientGone, SlotBusy, SlotUnavailable  # noqa: F401 - imported from here too
from kvproxy.telemetry import metrics


class SlotLock:
    """Mutual exclusion on the slot across threads and processes."""

    def __init__(self, lock_path: Path, timeout: float, max_waiters: int):
        self.path = lock_path
        self.timeout = timeout
        self.max_waiters = max_waiters
        self.thread_lock = threading.Lock()
        self._file_lock = filelock.FileLock(str(lock_path), thread_local=False)
        self._count_lock = threading.Lock()
        self.waiting = 0

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
            try:
                self._file_lock.acquire(timeout=0)
            except filelock.Timeout:  # another process holds the slot
                waited = True
                self._file_lock.acquire(timeout=max(0.0, bound - (time.monotonic() - started)))
        except filelock.Timeout:
            self.thread_lock.release()
            raise self._busy(started, bound) from None
        except Exception as exc:  # noqa: BLE001 - read-only, full, lockless filesystems...
            self.thread_lock.release()
            raise _lock_unusable(exc) from exc
        except BaseException:
            self.thread_lock.release()
            raise
        metrics.LOCK_WAIT.observe(time.monotonic() - started)
        return waited

    def try_acquire(self) -> bool:
        """Take the slot only if nobody (thread or process) holds it; never waits.
        Raises ``SlotUnavailable`` when the file lock cannot be taken at all."""
        if not self.thread_lock.acquire(blocking=False):
            return False
        try:
            self._file_lock.acquire(timeout=0)
        except filelock.Timeout:
            self.thread_lock.release()
            return False
        except Exception as exc:  # noqa: BLE001 - read-only, full, lockless filesystems...
            self.thread_lock.release()
            raise _lock_unusable(exc) from exc
        except BaseException:
            self.thread_lock.release()
            raise
        return True

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

    def release(self) -> None:
        """Free both locks; the thread lock even when the file lock's release fails."""
        try:
            self._file_lock.release()
        finally:
            self.thread_lock.release()


def _lock_unusable(exc: Exception) -> SlotUnavailable:
    """A lock error that is not a timeout: the folder, not a holder, is the problem."""
    return SlotUnavailable(f"the slot lock cannot be taken ({exc.__class__.__name__}: {exc}); "
                           "check that the slot folder is writable")
