"""Prometheus metrics, served at GET /metrics (prometheus-client), and the request log.

The counters the core updates live in ``kvproxy.telemetry.metrics``, on the registry
served here. What lives on disk (slot folder bytes, the active session) is read at
scrape time by ``SlotFolderCollector``, so it is right even when another
process changed the folder. ``init_app`` wires both into an app.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvproxy import routes
from kvproxy.sessions import identity
from kvproxy.slots.state import SlotTable
from kvproxy.storage.usage import FolderUsage, folder_usage
from kvproxy.telemetry.metrics import REGISTRY, REQUESTS, REQUEST_SECONDS

ACTIVE_HELP = ("Slots holding a session of this kind: client (an id the client sent), "
               "conversation, system, default or side")
SLOT_TOKENS_HELP = "Tokens the slots hold, as last recorded (all slots together)"
HELD_HELP = "Tokens each slot holds, as last recorded"

log = logging.getLogger("kvproxy.requests")



def slot_folder_usage(root: str | Path) -> tuple[int, int]:
    """``(bytes, files)`` the saved sessions take in ``root`` (``storage.usage``)."""
    usage = folder_usage(root)
    return usage.stored_bytes, usage.files


DIR_BYTES_HELP = ("Bytes the saved sessions take in the slot folder: whole slot files, "
                  "manifests and shared chunks (each once)")
DIR_FILES_HELP = "Saved sessions and base snapshots in the slot folder (whole files or manifests)"
LOGICAL_HELP = ("Bytes of the slot files the saved sessions stand for (as llama-server wrote "
                "them); kvproxy_slot_dir_bytes over this is what sharing chunks saves")
CHUNKS_HELP = "Chunks stored in the slot folder (KVPROXY_SESSION_STORE=chunks)"


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
        yield GaugeMetricFamily("kvproxy_slot_dir_bytes", DIR_BYTES_HELP)
        yield GaugeMetricFamily("kvproxy_slot_dir_files", DIR_FILES_HELP)
        yield GaugeMetricFamily("kvproxy_store_logical_bytes", LOGICAL_HELP)
        yield GaugeMetricFamily("kvproxy_store_chunks", CHUNKS_HELP)
        yield GaugeMetricFamily("kvproxy_active_session", ACTIVE_HELP,
                                labels=["kind", "persistent"])
        yield GaugeMetricFamily("kvproxy_slot_tokens", SLOT_TOKENS_HELP)
        yield GaugeMetricFamily("kvproxy_slot_held_tokens", HELD_HELP, labels=["slot"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        store = self._store()
        usage = FolderUsage()
        table: dict = {}
        if store is not None:
            usage = folder_usage(store.root)
            try:
                table = SlotTable(store).read()
            except Exception:  # a scrape must not fail on a bad state file
                table = {}
        yield GaugeMetricFamily("kvproxy_slot_dir_bytes", DIR_BYTES_HELP, value=usage.stored_bytes)
        yield GaugeMetricFamily("kvproxy_slot_dir_files", DIR_FILES_HELP, value=usage.files)
        yield GaugeMetricFamily("kvproxy_store_logical_bytes", LOGICAL_HELP,
                                value=usage.logical_bytes)
        yield GaugeMetricFamily("kvproxy_store_chunks", CHUNKS_HELP, value=usage.chunks)
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
    quiet = frozenset(route.path for route in routes.ROUTES if route.quiet)

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

        # Polled by monitors, health checks and the status page (the route table's
        # ``quiet``): their request lines go out at DEBUG only.
        level = logging.DEBUG if route in quiet else logging.INFO

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
