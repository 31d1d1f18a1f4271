"""Prometheus metrics, served at GET /metrics (prometheus-client), and the request log.

Counters and histograms are module globals that the switch and the relay
update. What lives on disk (slot folder bytes, the active session) is read at
scrape time by ``SlotFolderCollector``, so it is right even when another
process changed the folder. ``init_app`` wires both into an app.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvproxy.sessions import identity
from kvproxy.slots.state import SlotTable
from kvproxy.storage.store import bytes_with_companions

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

ACTIVE_HELP = ("Slots holding a session of this kind: client (an id the client sent), "
               "conversation, system, default or side")
SLOT_TOKENS_HELP = "Tokens the slots hold, as last recorded (all slots together)"
HELD_HELP = "Tokens each slot holds, as last recorded"

log = logging.getLogger("kvproxy.requests")

# Polled by monitors, health checks and the status page: their request lines go out at DEBUG only.
QUIET_ROUTES = frozenset({"/health", "/metrics", "/api/status"})


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


def slot_folder_usage(root: str | Path) -> tuple[int, int]:
    """``(bytes, files)`` of the ``*.bin`` slot files in ``root`` (bytes with their companion
    files); files vanishing mid-scan are skipped, and so is the start-up check's probe
    (written and deleted at once)."""
    total = count = 0
    try:
        paths = [p for p in Path(root).glob("*.bin") if not p.name.startswith("probe.")]
    except OSError:
        return 0, 0
    for path in paths:
        try:
            stat = path.stat()
        except OSError:
            continue
        if path.is_file():
            total += bytes_with_companions(path)   # llama-server's <file>.ckpt counts too
            count += 1
    return total, count


class SlotFolderCollector(Collector):
    """Gauges read at scrape time from the slot folder and the store's state file.

    One collector serves every app in the process: it asks the app serving the
    scrape (``flask.current_app``) for its store, else the app set up last.
    """

    def __init__(self) -> None:
        self._fallback: Callable[[], object] | None = None

    def bind(self, store_getter: Callable[[], object]) -> None:
        self._fallback = store_getter

    def _store(self):
        try:
            from flask import current_app
            switch = current_app.extensions.get("kvproxy.switch")
            if switch is not None:
                return switch.store
        except RuntimeError:  # outside an app context
            pass
        return self._fallback() if self._fallback else None

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Fixed families, so registration checks names without touching the disk.
        yield GaugeMetricFamily("kvproxy_slot_dir_bytes", "Bytes of *.bin slot files in the slot folder")
        yield GaugeMetricFamily("kvproxy_slot_dir_files", "Number of *.bin slot files in the slot folder")
        yield GaugeMetricFamily("kvproxy_active_session", ACTIVE_HELP,
                                labels=["kind", "persistent"])
        yield GaugeMetricFamily("kvproxy_slot_tokens", SLOT_TOKENS_HELP)
        yield GaugeMetricFamily("kvproxy_slot_held_tokens", HELD_HELP, labels=["slot"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        store = self._store()
        n_bytes = n_files = 0
        table: dict = {}
        if store is not None:
            n_bytes, n_files = slot_folder_usage(store.root)
            try:
                table = SlotTable(store).read()
            except Exception:  # a scrape must not fail on a bad state file
                table = {}
        yield GaugeMetricFamily("kvproxy_slot_dir_bytes",
                                "Bytes of *.bin slot files in the slot folder", value=n_bytes)
        yield GaugeMetricFamily("kvproxy_slot_dir_files",
                                "Number of *.bin slot files in the slot folder", value=n_files)
        active = GaugeMetricFamily("kvproxy_active_session", ACTIVE_HELP,
                                   labels=["kind", "persistent"])
        kinds: dict[tuple[str, str], int] = {}
        for state in table.values():
            if state.session_id:
                # The kind of id, never the id: ids can be e-mail addresses (OpenAI's ``user``).
                kind = identity.kind_of_key(state.key or state.session_id)
                label = (kind, "true" if state.persistent else "false")
                kinds[label] = kinds.get(label, 0) + 1
        for label, count in sorted(kinds.items()):
            active.add_metric(list(label), count)
        yield active
        yield GaugeMetricFamily("kvproxy_slot_tokens", SLOT_TOKENS_HELP,
                                value=sum(state.tokens for state in table.values()))
        held = GaugeMetricFamily("kvproxy_slot_held_tokens", HELD_HELP, labels=["slot"])
        for slot, state in sorted(table.items()):
            held.add_metric([str(slot)], state.tokens)
        yield held


SLOT_FOLDER = SlotFolderCollector()
REGISTRY.register(SLOT_FOLDER)


def _fmt(value: object) -> str:
    """A log field value: bare when simple, quoted otherwise; one event stays one line,
    so control characters, line separators and lone surrogates are escaped."""
    text = "-" if value is None or value == "" else str(value)
    if text.isascii() and text.isprintable() and not any(c in text for c in ' "=\\'):
        return text
    escaped = json.dumps(text, ensure_ascii=False)[1:-1]  # \n, \", \\, \u0007 ...
    escaped = "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace")
                      .decode("ascii") for c in escaped)
    return f'"{escaped}"'



def format_request_line(fields: dict) -> str:
    return " ".join(f"{key}={_fmt(value)}" for key, value in fields.items())


def init_app(app) -> None:
    """Count every request by route and status, log one line per request, expose folder gauges."""
    from flask import g, request

    switch = app.extensions.get("kvproxy.switch")
    if switch is not None:
        SLOT_FOLDER.bind(lambda: switch.store)

    @app.before_request
    def start_clock():
        g.kvproxy_started = time.perf_counter()

    @app.after_request
    def count_request(response):
        route = request.url_rule.rule if request.url_rule else "unmatched"
        REQUESTS.labels(route, str(response.status_code)).inc()
        started = getattr(g, "kvproxy_started", None) or time.perf_counter()
        fields = {
            "method": request.method,
            "route": route,
            "path": request.path,
            "status": response.status_code,
            "session": response.headers.get("X-KVProxy-Session"),
            "cache": response.headers.get("X-KVProxy-Cache"),
        }

        level = logging.DEBUG if route in QUIET_ROUTES else logging.INFO

        def finish(streamed: bool) -> None:
            elapsed = time.perf_counter() - started
            REQUEST_SECONDS.labels(route).observe(elapsed)
            if log.isEnabledFor(level):
                log.log(level, "request %s", format_request_line(
                    {**fields, "streamed": "true" if streamed else "false",
                     "duration_ms": f"{elapsed * 1000:.1f}"}))

        # The body is sent after this hook: time and log it when the server closes the
        # response, which also keeps the log write off the client's wait.
        streamed = response.is_streamed
        done = []

        def on_close() -> None:
            if not done:
                done.append(True)
                finish(streamed)

        response.call_on_close(on_close)
        return response
