"""Saved sessions pushed to the shared store behind the request path, by one thread.

A pack of the slot folder (``ChunkedFiles``) names the session (``saved``) and returns at
once. The queue holds one entry per conversation (only its newest save matters: a newer save
takes the waiting entry's place), at most ``limit`` of them; past it the oldest waiting one is
dropped and counted, its local copy kept. A failed upload goes back to the head of the queue
and the thread waits before trying again, twice as long each time up to ``MAX_BACKOFF``
seconds, so a store outage costs no request anything: ``problem`` says why for ``/health``
and clears with the next upload that succeeds. While another node sweeps the bucket, uploads
wait the same way (not a failure; ``publish`` says why), and a session object written as a
sweep began is queued once more to have its chunks checked (``Recheck``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvproxy.errors import StorageError, StoreError
from kvproxy.storage.shared import publish as publishing
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.telemetry import metrics

log = logging.getLogger("kvproxy.store")

FIRST_BACKOFF = 0.5
MAX_BACKOFF = 30.0


@dataclass(frozen=True)
class Deletion:
    """A queue entry: the conversation was deleted here (the admin API), so its session
    object goes from the bucket too."""

    files: object


@dataclass(frozen=True)
class Recheck:
    """A queue entry: the session's save is in the bucket, but a sweep began while it was
    written, so each chunk it names is looked at again (and put back if missing)."""

    files: object


def next_backoff(current: float) -> float:
    """The wait after one more failure in a row."""
    return min(MAX_BACKOFF, max(FIRST_BACKOFF, current * 2))


class Uploader:
    """The shared store's upload queue and the thread that empties it."""

    def __init__(self, bucket: Bucket, limit: int = 256):
        self.bucket = bucket
        self.limit = limit
        self.known = publishing.KnownChunks()
        # stem -> its ChunkedFiles (upload its newest save), a Recheck or a Deletion
        self._pending: OrderedDict[str, object] = OrderedDict()
        self._busy: str | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._problem: str | None = None
        self.dropped = 0
        # Sessions saved before this process started, checked when nothing else waits.
        self._catch_up: list[tuple[str, object]] = []

    # -- the request side: never waits on the store -------------------------------------
    def saved(self, files, stem: str) -> None:
        """``stem`` was packed in ``files``' slot folder: upload its newest save soon."""
        self._queue(stem, files)

    def deleted(self, files, stem: str) -> None:
        """``stem`` was deleted from ``files``' slot folder: delete it from the bucket soon
        (in place of an upload of it still waiting)."""
        self._queue(stem, Deletion(files))

    def catch_up(self, files, stems: list[str]) -> None:
        """``stems`` were saved in ``files``' slot folder before this process started (some
        perhaps never uploaded: a crash, a store outage): upload each the bucket lacks a save
        as new of, one at a time, whenever no newer save waits."""
        with self._cond:
            self._catch_up.extend((stem, files) for stem in reversed(stems))
            self._start()
            self._cond.notify()

    def _queue(self, stem: str, job) -> None:
        with self._cond:
            if stem not in self._pending and len(self._pending) >= self.limit:
                oldest, _ = self._pending.popitem(last=False)
                self.dropped += 1
                metrics.STORE_UPLOADS_DROPPED.inc()
                log.warning("upload queue full (%d): dropped the waiting upload of %s (its "
                            "local copy stays; KVPROXY_STORE_QUEUE)", self.limit, oldest)
            self._pending[stem] = job
            metrics.STORE_UPLOAD_QUEUE.set(len(self._pending))
            self._start()
            self._cond.notify()

    def _start(self) -> None:
        """The thread starts with the first upload: in the serving process, after any fork."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvproxy-store-upload",
                                            daemon=True)
            self._thread.start()

    # -- what others read ------------------------------------------------------------
    def problem(self) -> str | None:
        """Why the shared store is not being written now (None: it is, or nothing waits)."""
        with self._cond:
            if self._problem is None:
                return None
            return f"{self._problem} ({len(self._pending)} upload(s) waiting)"

    def waiting(self) -> int:
        """Uploads waiting or under way, catch-up included."""
        with self._cond:
            return len(self._pending) + len(self._catch_up) + (1 if self._busy else 0)

    def wait_idle(self, timeout: float) -> bool:
        """Whether every queued upload was done within ``timeout`` seconds (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._catch_up or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 5) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------
    def _take(self) -> tuple[str, object] | None:
        with self._cond:
            while not self._pending and not self._catch_up and not self._stop.is_set():
                self._cond.wait(1.0)
            if self._stop.is_set():
                return None
            if self._pending:
                stem, files = self._pending.popitem(last=False)
            else:
                stem, files = self._catch_up.pop()
            self._busy = stem
            metrics.STORE_UPLOAD_QUEUE.set(len(self._pending))
            return stem, files

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            job = self._take()
            if job is None:
                return
            stem, files = job
            try:
                started = time.monotonic()
                done = self._carry_out(stem, files)
                metrics.observe_upload(done.outcome, done.chunk_bytes, done.session_bytes,
                                       time.monotonic() - started)
                if done.outcome == publishing.NEWER_THERE:
                    log.info("did not upload %s: the store holds a later save of it", stem)
                if done.outcome == publishing.SWEEP_UNDER_WAY:
                    backoff = next_backoff(backoff)
                    log.info("upload of %s waits %.1f s for a sweep of the shared store",
                             stem, backoff)
                    self._settle(stem, None, files)
                    self._stop.wait(backoff)
                    continue
                backoff = 0.0
                self._settle(stem, None, Recheck(files) if done.recheck else None)
            except (StoreError, StorageError) as exc:   # the store, or the slot folder's lock
                backoff = next_backoff(backoff)
                metrics.STORE_UPLOAD_FAILURES.inc()
                log.warning("upload of %s to the shared store failed, trying again in %.1f s: "
                            "%s", stem, backoff, exc)
                self._settle(stem, str(exc), files)
                self._stop.wait(backoff)
            except Exception:   # a bug: logged, the thread goes on with the next upload
                log.exception("upload of %s to the shared store failed", stem)
                self._settle(stem, None)

    def _carry_out(self, stem: str, job) -> publishing.Published:
        if isinstance(job, Deletion):
            return publishing.unpublish(self.bucket, stem)
        if isinstance(job, Recheck):
            return publishing.publish(self.bucket, job.files, stem, self.known, recheck=True)
        return publishing.publish(self.bucket, job, stem, self.known)

    def _settle(self, stem: str, problem: str | None, files=None) -> None:
        """The end of one try: ``files`` (a failed or postponed upload, or a recheck) goes
        to the head of the queue unless a newer save of it is already waiting."""
        with self._cond:
            self._busy = None
            self._problem = problem
            if files is not None and stem not in self._pending:
                self._pending[stem] = files
                self._pending.move_to_end(stem, last=False)
            metrics.STORE_UPLOAD_QUEUE.set(len(self._pending))
            self._cond.notify_all()
