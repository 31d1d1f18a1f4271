"""This node's side of the shared store: where it is, the uploader that fills it, and the
fetch on miss that reads it.

Built once per process from the settings (``KVPROXY_STORE_URL``; None when it is empty) and
handed to every model's ``ChunkedFiles``, which tells it of each packed save and asks it for
a session its folder lacks.
"""
from __future__ import annotations

import logging
import time

from kvproxy.errors import StorageError, StoreError, StoreUnavailable
from kvproxy.storage.chunks import manifest
from kvproxy.storage.shared import fetch as fetching
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation
from kvproxy.storage.shared.sweeper import Sweeper, node_id
from kvproxy.storage.shared.uploader import Uploader
from kvproxy.telemetry import metrics
from kvproxy.telemetry.pace import Pace

log = logging.getLogger("kvproxy.store")

LEAST_DOWNLOAD = 1 << 20   # bytes: smaller fetches teach nothing of the store's speed
QUIET_SECONDS = 15.0       # no lookups for this long after one found the store unreachable


class SharedStore:
    """The bucket and this process's upload queue."""

    def __init__(self, bucket: Bucket, queue: int = 256, fetch_seconds: float = 30.0,
                 sweep_grace: float = 3600.0, sweep_minutes: float = 0, node: str = "",
                 budget: int = 0, clock=time.monotonic):
        self.bucket = bucket
        self.clock = clock
        self.uploader = Uploader(bucket, queue)
        self.fetch_seconds = fetch_seconds
        self.download = Pace(least_units=LEAST_DOWNLOAD)   # bytes per second of fetches
        self._quiet_until = 0.0   # by ``clock``: the store was unreachable just now
        self.sweeper = Sweeper(bucket, sweep_grace, sweep_minutes, node_id(node),
                               self.uploader.known, budget=budget)

    @classmethod
    def of(cls, settings) -> "SharedStore | None":
        if not getattr(settings, "store_url", ""):
            return None
        return cls(Bucket(StoreLocation.parse(settings.store_url), settings.store_timeout),
                   settings.store_queue, settings.store_fetch_seconds,
                   settings.store_sweep_grace_seconds, settings.store_sweep_minutes,
                   settings.node_name, int(settings.store_max_gb * 1024**3))

    @property
    def url(self) -> str:
        return self.bucket.location.url

    def saved(self, files, stem: str) -> None:
        """A save of ``stem`` was packed in ``files``' slot folder."""
        self.uploader.saved(files, stem)

    def catch_up(self, files) -> int:
        """At start-up: have every session saved as chunks in ``files``' slot folder checked
        against the bucket in the background (newest first); how many (none when those files
        do not copy to this store: KVPROXY_SESSION_STORE=files)."""
        if getattr(files, "shared", None) is not self:
            return 0
        paths = sorted(files.store.root.glob(f"*{manifest.SUFFIX}"),
                       key=lambda path: path.stat().st_mtime if path.exists() else 0,
                       reverse=True)
        stems = [path.name[:-len(manifest.SUFFIX)] for path in paths]
        if stems:
            log.info("checking %d saved session(s) against the shared store %s in the "
                     "background", len(stems), self.url)
            self.uploader.catch_up(files, stems)
        return len(stems)

    def deleted(self, files, stem: str) -> None:
        """``stem`` was deleted from ``files``' slot folder through the admin API."""
        self.uploader.deleted(files, stem)

    def fetch(self, files, stem: str, prefill: Pace | None = None) -> bool:
        """Fetch on miss: whether ``stem`` is now in ``files``' slot folder. A failure, or a
        fetch slower than computing the prompt at ``prefill``'s pace, is one log line, and
        the caller computes the prompt instead."""
        started = time.monotonic()
        if self.clock() < self._quiet_until:   # unreachable a moment ago: compute at once
            metrics.observe_fetch("store down", 0, 0.0)
            return False

        def race(tokens: int, n_bytes: int) -> fetching.Race:
            compute_s = prefill.seconds_for(tokens) if prefill is not None and tokens else None
            return fetching.fetch_or_compute(tokens, n_bytes, compute_s,
                                             self.download.seconds_for(n_bytes),
                                             self.fetch_seconds)
        try:
            done = fetching.fetch(self.bucket, files, stem, self.fetch_seconds, race)
        except (StoreError, StorageError) as exc:
            metrics.observe_fetch("failed", 0, time.monotonic() - started)
            quiet = isinstance(exc, StoreUnavailable)
            if quiet:
                self._quiet_until = self.clock() + QUIET_SECONDS
            log.warning("could not fetch %s from the shared store, computing it instead: %s%s",
                        stem, exc, f" (no lookups for {QUIET_SECONDS:.0f} s)" if quiet else "")
            return False
        metrics.observe_fetch(done.outcome, done.bytes, done.seconds)
        if done.outcome == fetching.SLOWER:
            log.info("computing %s instead of fetching it from the shared store: %s", stem,
                     done.why)
            return False
        if done.outcome == fetching.FOUND:
            self.download.note(done.bytes, done.seconds)
            log.info("fetched %s from the shared store: %d chunk(s), %d bytes in %.2f s",
                     stem, done.chunks, done.bytes, done.seconds)
            return True
        return False

    def problem(self) -> str | None:
        return self.uploader.problem()

    def drain(self, timeout: float) -> bool:
        """At exit: wait up to ``timeout`` seconds for the waiting uploads, then stop; whether
        all went (else one log line: their local copies stay, unuploaded)."""
        done = self.uploader.wait_idle(timeout)
        if not done:
            log.warning("%d upload(s) did not reach the shared store before exit; their local "
                        "copies stay", self.uploader.waiting())
        self.close(1)
        return done

    def start_sweeps(self) -> None:
        """In the serving process: sweep the bucket every KVPROXY_STORE_SWEEP_MINUTES."""
        self.sweeper.start()

    def sweep(self):
        """A sweep now, if this node can take the lease (``sweeper.Outcome``)."""
        return self.sweeper.run_once()

    def close(self, timeout: float = 5) -> None:
        self.sweeper.close(timeout)
        self.uploader.close(timeout)
