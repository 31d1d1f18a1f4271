"""When the bucket is swept: every ``minutes`` by a thread of each node, and on demand (the
admin API), always under the sweep lease, so one node sweeps at a time.

After taking the lease a sweep waits ``settle`` seconds before it lists the bucket: an
upload that saw the lease free just before writes its session object within that time, so
the listing sees it and its chunks stay (``publish``; an upload whose write took longer
checks its chunks again once the sweep is over).

Each sweep is one log line (chunks checked, deleted, bytes freed, seconds) and counts in
``/metrics``; chunks it deleted are forgotten by this node's uploader, which then uploads them
again when a save names them.
"""
from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass

from kvproxy.errors import StoreError
from kvproxy.storage.shared import sweep as sweeping
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.lease import SWEEP, Lease
from kvproxy.telemetry import metrics

log = logging.getLogger("kvproxy.store")

LEASE_SECONDS = 900.0   # a sweep longer than this stops deleting and leaves the rest
SETTLE_SECONDS = 5.0    # for uploads that saw the lease free to write their session object


@dataclass(frozen=True)
class Outcome:
    """What asking for a sweep did: ``swept`` (``done`` says what), or not, and why."""

    swept: bool
    done: sweeping.Swept | None = None
    holder: str | None = None    # the node that holds the lease, when another does
    until: float | None = None   # and until when (seconds since the epoch)

    def record(self) -> dict:
        done = self.done
        return {"swept": self.swept, "holder": self.holder, "until": self.until,
                "checked": done.checked if done else 0, "deleted": done.deleted if done else 0,
                "freed_bytes": done.freed if done else 0,
                "seconds": round(done.seconds, 3) if done else 0.0,
                "problem": done.problem if done else None,
                "evicted": done.evicted if done else 0,
                "evicted_chunks": done.evicted_chunks if done else 0,
                "evicted_bytes": done.evicted_bytes if done else 0,
                "stored_bytes": done.stored if done else 0,
                "budget_bytes": done.budget if done else 0}


def node_id(name: str = "") -> str:
    """This process among the nodes: its node name (else host name) and process id."""
    return f"{name or socket.gethostname()}:{os.getpid()}"


class Sweeper:
    """This node's sweeps of ``bucket``."""

    def __init__(self, bucket: Bucket, grace: float, minutes: float, node: str = "",
                 known=None, lease_seconds: float = LEASE_SECONDS, budget: int = 0,
                 settle: float = SETTLE_SECONDS):
        self.bucket = bucket
        self.grace = grace
        self.minutes = minutes
        self.lease = Lease(bucket, SWEEP, node or node_id(), lease_seconds)
        self.known = known
        self.budget = budget   # bytes (KVPROXY_STORE_MAX_GB; 0: none)
        self.settle = settle
        self._lock = threading.Lock()   # one sweep at a time in this process
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> Outcome:
        """Sweep now if this node can take the lease (``StoreError`` when the store fails;
        nothing is deleted after a listing or a read that failed)."""
        with self._lock:
            if not self.lease.take():
                other = self.lease.other
                metrics.STORE_SWEEPS.labels("leased elsewhere").inc()
                return Outcome(False, holder=other.node if other else None,
                               until=other.expires if other else None)
            try:
                time.sleep(self.settle)
                done = sweeping.sweep(self.bucket, self.grace, self.lease.left,
                                      budget=self.budget)
            except StoreError:
                metrics.STORE_SWEEPS.labels("failed").inc()
                raise
            finally:
                try:
                    self.lease.release()
                except StoreError as exc:   # it expires by itself
                    log.warning("could not release the sweep lease: %s", exc)
        self._forget(done.deleted_keys)
        metrics.observe_sweep(done)
        log.info("swept the shared store: %s", done.summary())
        return Outcome(True, done)

    def _forget(self, names) -> None:
        if self.known is not None:
            for name in names:
                self.known.discard(name)

    # -- the thread --------------------------------------------------------------------
    def start(self) -> None:
        """Sweep every ``minutes`` from now on (0: never); in the serving process, after any
        fork."""
        if self.minutes <= 0 or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._run, name="kvproxy-store-sweep",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = self.minutes * 60
        # Nodes started together spread their first tries over the period.
        wait = period * (0.5 + random.random() / 2)
        while not self._stop.wait(wait):
            wait = period
            try:
                outcome = self.run_once()
                if not outcome.swept:
                    log.debug("sweep skipped: %s holds the sweep lease", outcome.holder)
            except StoreError as exc:
                log.warning("sweep of the shared store failed, nothing more deleted: %s", exc)
            except Exception:   # a bug: logged, the thread tries again next period
                log.exception("sweep of the shared store failed")

    def close(self, timeout: float = 5) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
