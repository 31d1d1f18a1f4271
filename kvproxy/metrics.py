"""Prometheus metrics, served at GET /metrics (prometheus-client)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()

REQUESTS = Counter("kvproxy_requests_total", "Client requests by route and status",
                   ["route", "status"], registry=REGISTRY)
SWAPS = Counter("kvproxy_swaps_total", "Slot actions by kind (save, restore, erase, base, none)",
                ["kind"], registry=REGISTRY)
SWAP_SECONDS = Histogram("kvproxy_swap_seconds", "Duration of slot actions by kind", ["kind"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                         registry=REGISTRY)
SWAP_BYTES = Counter("kvproxy_swap_bytes_total", "Bytes written or read by slot actions", ["kind"],
                     registry=REGISTRY)
LOCK_WAIT = Histogram("kvproxy_lock_wait_seconds", "Time requests waited for the slot",
                      buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 15, 60, 300), registry=REGISTRY)
TOKENS = Counter("kvproxy_prompt_tokens_total", "Prompt tokens reused from cache or computed",
                 ["kind"], registry=REGISTRY)
RESTORE_MISSES = Counter("kvproxy_restore_misses_total",
                         "Restores refused, failed or not honoured by llama-server", ["reason"],
                         registry=REGISTRY)


def observe_swap(kind: str, seconds: float, n_bytes: int) -> None:
    SWAPS.labels(kind).inc()
    SWAP_SECONDS.labels(kind).observe(seconds)
    if n_bytes:
        SWAP_BYTES.labels(kind).inc(n_bytes)


def init_app(app) -> None:
    """Count every request by route and status."""

    @app.after_request
    def count_request(response):
        from flask import request
        route = request.url_rule.rule if request.url_rule else "unmatched"
        REQUESTS.labels(route, str(response.status_code)).inc()
        return response
