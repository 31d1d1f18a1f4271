"""The counters and histograms kvproxy keeps, on one registry that /metrics serves.

The core counts where things happen (a swap in the executor, a wait in the pool, an
eviction in the slot folder) by updating these module globals; serving them is the
operator side's job (``kvproxy.ops.metrics``). Nothing of kvproxy is imported here, so
every layer may count without depending on the one that serves the counts, as in
llama-swap's metrics monitor.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()

REQUESTS = Counter("kvproxy_requests_total", "Client requests by route and status",
                   ["route", "status"], registry=REGISTRY)
REQUEST_SECONDS = Histogram("kvproxy_request_seconds",
                            "Client request duration by route, to the last byte of the reply",
                            ["route"],
                            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                                     60, 120, 300),
                            registry=REGISTRY)
SWAPS = Counter("kvproxy_swaps_total", "Slot actions by kind (save, restore, erase, base, none)",
                ["kind"], registry=REGISTRY)
SLOT_SWAPS = Counter("kvproxy_slot_swaps_total",
                     "Swaps by slot and outcome: none (the slot held the session), save (of the "
                     "session it held), restored, base, miss", ["slot", "kind"], registry=REGISTRY)
SLOT_BUSY_SECONDS = Counter("kvproxy_slot_busy_seconds_total",
                            "Seconds each slot was leased to a request (swap and answer)",
                            ["slot"], registry=REGISTRY)
SWAP_SECONDS = Histogram("kvproxy_swap_seconds", "Duration of slot actions by kind", ["kind"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                         registry=REGISTRY)
SWAP_BYTES = Counter("kvproxy_swap_bytes_total", "Bytes written or read by slot actions", ["kind"],
                     registry=REGISTRY)
LOCK_WAIT = Histogram("kvproxy_lock_wait_seconds", "Time requests waited for the slot",
                      buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 15, 60, 300), registry=REGISTRY)
WAITERS = Gauge("kvproxy_slot_waiters", "Requests of this process waiting for the slot",
                registry=REGISTRY)
REJECTED = Counter("kvproxy_slot_rejected_total",
                   "Requests answered 503 without the slot: waited too long or too many waiting",
                   ["reason"], registry=REGISTRY)
TOKENS = Counter("kvproxy_prompt_tokens_total", "Prompt tokens reused from cache or computed",
                 ["kind"], registry=REGISTRY)
RESTORE_MISSES = Counter("kvproxy_restore_misses_total",
                         "Restores refused, failed or not honoured by llama-server", ["reason"],
                         registry=REGISTRY)
SAVES_BEHIND = Counter("kvproxy_saves_behind_total",
                       "Sessions saved in the background once their slot had settled",
                       registry=REGISTRY)
EVICTIONS = Counter("kvproxy_evictions_total",
                    "Slot files deleted to keep the slot folder within its bounds",
                    registry=REGISTRY)
SAVES_DROPPED = Counter("kvproxy_saves_dropped_total",
                        "Saves the slot folder could not take (no room, a failed write): the "
                        "session's newest turns were not kept on disk, the swap went ahead",
                        ["kind"], registry=REGISTRY)
SAVES_REFUSED = Counter("kvproxy_saves_refused_total",
                        "Saves not installed because llama-server saved another token count "
                        "than the slot was recorded with: something else ran in the slot",
                        ["kind"], registry=REGISTRY)
EVICTED_BYTES = Counter("kvproxy_evicted_bytes_total", "Bytes of slot files deleted by eviction",
                        registry=REGISTRY)


def observe_swap(kind: str, seconds: float, n_bytes: int) -> None:
    SWAPS.labels(kind).inc()
    SWAP_SECONDS.labels(kind).observe(seconds)
    if n_bytes:
        SWAP_BYTES.labels(kind).inc(n_bytes)


def observe_eviction(n_bytes: int = 0) -> None:
    """Count one slot file removed by eviction (and its size)."""
    EVICTIONS.inc()
    if n_bytes:
        EVICTED_BYTES.inc(n_bytes)


CHUNKED_SAVES = Counter("kvproxy_chunked_saves_total",
                        "Saves stored as chunks (KVPROXY_SESSION_STORE=chunks)", registry=REGISTRY)
SAVE_WRITTEN_BYTES = Counter("kvproxy_save_written_bytes_total",
                             "Bytes those saves wrote to the store: new chunks and manifests "
                             "(the file llama-server wrote is deleted at once)", registry=REGISTRY)
SAVE_LOGICAL_BYTES = Counter("kvproxy_save_logical_bytes_total",
                             "Bytes of the slot files those saves stored", registry=REGISTRY)


def observe_chunked_save(written: int, logical: int) -> None:
    """Count one save stored as chunks: what it wrote against the file it stored."""
    CHUNKED_SAVES.inc()
    SAVE_WRITTEN_BYTES.inc(written)
    SAVE_LOGICAL_BYTES.inc(logical)


HOT_RESTORES = Counter("kvproxy_hot_restores_total",
                       "Restores of sessions stored as chunks, by where the whole file came from "
                       "(hot: a hot copy in memory, KVPROXY_HOT_DIR; assembled: put together from "
                       "the chunks)", ["source"], registry=REGISTRY)


HOT_BYTES = Gauge("kvproxy_hot_bytes", "Bytes of the hot copies in KVPROXY_HOT_DIR (memory)",
                  registry=REGISTRY)


def count_hot_restore(hot: bool) -> None:
    """Count a restore from a hot copy, or one put together from chunks while hot copies are on."""
    HOT_RESTORES.labels("hot" if hot else "assembled").inc()


# -- the shared session store (KVPROXY_STORE_URL) ------------------------------------------
STORE_UPLOADS = Counter("kvproxy_store_uploads_total",
                        "Saved sessions the uploader handled, by outcome (written; already there; "
                        "newer there: another node's later save was kept; gone: replaced or deleted locally "
                        "before its turn; deleted: deleted here, so from the bucket too)",
                        ["outcome"], registry=REGISTRY)
STORE_UPLOAD_BYTES = Counter("kvproxy_store_upload_bytes_total",
                             "Bytes uploaded to the shared store, by kind (chunk, session)",
                             ["kind"], registry=REGISTRY)
STORE_UPLOAD_FAILURES = Counter("kvproxy_store_upload_failures_total",
                                "Uploads that failed and wait to be tried again",
                                registry=REGISTRY)
STORE_UPLOADS_DROPPED = Counter("kvproxy_store_uploads_dropped_total",
                                "Waiting uploads dropped because the queue was full (the local "
                                "copy is kept)", registry=REGISTRY)
STORE_UPLOAD_QUEUE = Gauge("kvproxy_store_upload_queue",
                           "Conversations whose newest save waits for its upload",
                           registry=REGISTRY)
STORE_UPLOAD_SECONDS = Histogram("kvproxy_store_upload_seconds",
                                 "Time to upload one saved session (its new chunks and its "
                                 "manifest)", buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                 registry=REGISTRY)


def observe_upload(outcome: str, chunk_bytes: int, session_bytes: int, seconds: float) -> None:
    STORE_UPLOADS.labels(outcome).inc()
    if chunk_bytes:
        STORE_UPLOAD_BYTES.labels("chunk").inc(chunk_bytes)
    if session_bytes:
        STORE_UPLOAD_BYTES.labels("session").inc(session_bytes)
    STORE_UPLOAD_SECONDS.observe(seconds)


STORE_SWEEPS = Counter("kvproxy_store_sweeps_total",
                       "Sweeps of the shared store asked for, by outcome (swept, leased "
                       "elsewhere: another node held the lease, failed)", ["outcome"],
                       registry=REGISTRY)
STORE_SWEEP_CHECKED = Counter("kvproxy_store_sweep_chunks_checked_total",
                              "Chunks in the shared store a sweep listed", registry=REGISTRY)
STORE_SWEEP_DELETED = Counter("kvproxy_store_sweep_chunks_deleted_total",
                              "Unnamed chunks a sweep deleted from the shared store",
                              registry=REGISTRY)
STORE_SWEEP_FREED = Counter("kvproxy_store_sweep_freed_bytes_total",
                            "Bytes a sweep deleted from the shared store: chunks, and the "
                            "session objects the size budget evicted", registry=REGISTRY)
STORE_SWEEP_EVICTED = Counter("kvproxy_store_sweep_sessions_evicted_total",
                              "Conversations (session objects) a sweep evicted from the shared "
                              "store to keep KVPROXY_STORE_MAX_GB; nodes keep their local copies",
                              registry=REGISTRY)
STORE_SWEEP_EVICTED_CHUNKS = Counter("kvproxy_store_sweep_chunks_evicted_total",
                                     "Of the chunks a sweep deleted, those only evicted "
                                     "conversations named", registry=REGISTRY)
STORE_SWEEP_EVICTED_BYTES = Counter("kvproxy_store_sweep_evicted_bytes_total",
                                    "Of the bytes a sweep freed, those the size budget evicted "
                                    "(session objects and their chunks)", registry=REGISTRY)
STORE_SWEEP_STORED = Gauge("kvproxy_store_sweep_stored_bytes",
                           "Bytes of chunks and session objects in the shared store when this "
                           "node last swept it, before deleting", registry=REGISTRY)


def observe_sweep(done) -> None:
    """A sweep that ran (``sweep.Swept``)."""
    STORE_SWEEPS.labels("swept").inc()
    STORE_SWEEP_CHECKED.inc(done.checked)
    STORE_SWEEP_DELETED.inc(done.deleted)
    STORE_SWEEP_FREED.inc(done.freed)
    STORE_SWEEP_EVICTED.inc(done.evicted)
    STORE_SWEEP_EVICTED_CHUNKS.inc(done.evicted_chunks)
    STORE_SWEEP_EVICTED_BYTES.inc(done.evicted_bytes)
    STORE_SWEEP_STORED.set(done.stored)


STORE_FETCHES = Counter("kvproxy_store_fetches_total",
                        "Sessions the slot folder lacked, looked up in the shared store, by "
                        "outcome (fetched, not in the store, failed: computed instead)",
                        ["outcome"], registry=REGISTRY)
STORE_FETCH_BYTES = Counter("kvproxy_store_fetch_bytes_total",
                            "Bytes fetched from the shared store", registry=REGISTRY)
STORE_FETCH_SECONDS = Histogram("kvproxy_store_fetch_seconds",
                                "Time to fetch one session from the shared store",
                                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                registry=REGISTRY)


def observe_fetch(outcome: str, n_bytes: int, seconds: float) -> None:
    STORE_FETCHES.labels(outcome).inc()
    if n_bytes:
        STORE_FETCH_BYTES.inc(n_bytes)
    STORE_FETCH_SECONDS.observe(seconds)
