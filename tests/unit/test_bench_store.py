"""The shared store benchmark's readings: the fetch time kvproxy's header names, the store's
samples of a /metrics page and the upload rate made of them, and the page section a run
renders (medians, every round, the load average)."""
from __future__ import annotations

from bench import store

METRICS = """\
# HELP kvproxy_store_upload_bytes_total Bytes uploaded to the shared store
# TYPE kvproxy_store_upload_bytes_total counter
kvproxy_store_upload_bytes_total{kind="chunk"} 3.0e+07
kvproxy_store_upload_bytes_total{kind="session"} 5.0e+06
# HELP kvproxy_store_upload_seconds Time of one upload
# TYPE kvproxy_store_upload_seconds histogram
kvproxy_store_upload_seconds_bucket{le="1.0"} 1.0
kvproxy_store_upload_seconds_bucket{le="+Inf"} 2.0
kvproxy_store_upload_seconds_count 2.0
kvproxy_store_upload_seconds_sum 1.75
# HELP kvproxy_store_uploads_total Uploads by outcome
# TYPE kvproxy_store_uploads_total counter
kvproxy_store_uploads_total{outcome="written"} 2.0
# HELP kvproxy_store_upload_queue Waiting uploads
# TYPE kvproxy_store_upload_queue gauge
kvproxy_store_upload_queue 0.0
# HELP kvproxy_requests_total Requests
# TYPE kvproxy_requests_total counter
kvproxy_requests_total{route="/v1/chat/completions",status="200"} 4.0
"""


def test_fetched_ms_reads_only_a_store_fetch():
    assert store.fetched_ms("store; ms=412.5") == 412.5
    assert store.fetched_ms("store; ms=7") == 7.0
    assert store.fetched_ms(None) is None
    assert store.fetched_ms("") is None
    assert store.fetched_ms("local; ms=3") is None


def test_store_metrics_keep_the_stores_samples_by_kind_and_outcome():
    found = store.store_metrics(METRICS)
    assert found["kvproxy_store_upload_bytes_total{kind=chunk}"] == 3e7
    assert found["kvproxy_store_upload_bytes_total{kind=session}"] == 5e6
    assert found["kvproxy_store_upload_seconds_count"] == 2
    assert found["kvproxy_store_uploads_total{outcome=written}"] == 2
    assert found["kvproxy_store_upload_queue"] == 0
    assert not any(k.startswith(("kvproxy_requests", "kvproxy_store_upload_seconds_bucket"))
                   for k in found)


def test_upload_figures_add_both_kinds_and_divide_by_the_time_spent():
    figures = store.upload_figures(store.store_metrics(METRICS))
    assert figures == {"bytes": 35_000_000, "seconds": 1.75, "uploads": 2, "mb_per_s": 20.0}
    assert store.upload_figures({})["mb_per_s"] is None


def test_delta_is_what_a_round_added():
    assert store.delta({"a": 5.0, "b": 1.0}, {"a": 2.0}) == {"a": 3.0, "b": 1.0}


def turn(seconds, cache="restored", reused=5900, prompt=6000, fetch_ms=None):
    return {"seconds": seconds, "cache": cache, "reused_tokens": reused,
            "prompt_tokens": prompt, "fetch_ms": fetch_ms}


def a_round(store_s, local_s, cold_s, in_store_s, fetch_ms):
    return {"system_tokens": 5600, "first_tokens": 400, "in_store_s": in_store_s,
            "first": turn(60.0, "miss", 0, 6010),
            "upload": {"bytes": 140_000_000, "seconds": 2.0, "uploads": 2, "mb_per_s": 70.0},
            "fetch_bytes": 140_000_000, "fetch_seconds": 0.5,
            "store": turn(store_s, fetch_ms=fetch_ms), "local": turn(local_s),
            "cold": {"seconds": cold_s, "prompt_tokens": 6030, "reused_tokens": 0}}


def test_report_gives_medians_every_round_and_the_load():
    run = {"started": "2026-12-06 21:00 UTC", "weed": "4.48", "answer_tokens": 1,
           "load": {"before": {"cores": 2, "cpu": "x86_64", "loadavg": [2.5, 2.0, 1.5]},
                    "after": {"cores": 2, "cpu": "x86_64", "loadavg": [3.0, 2.5, 2.0]}},
           "rounds": [a_round(2.0, 1.0, 60.0, 1.5, 400.0), a_round(4.0, 3.0, 80.0, 2.5, 600.0)]}
    text = store.report(run)
    assert text.startswith(store.START) and text.endswith(store.END)
    assert "load average 2.5 2.0 1.5 at start, 3.0 2.5 2.0 at end" in text
    assert "| a fresh node B, empty slot folder: from the store | restored | 98.3% | " \
           "3.00 s (2.00, 4.00) | 500 ms |" in text
    assert "its own disk | restored | 98.3% | 2.00 s (1.00, 3.00) | - |" in text
    assert "| 0.0% | 70.00 s (60.00, 80.00) | - |" in text
    assert "From the store against a cold prefill: 23.3x faster" in text
    assert "against the local disk: 1.50x its time" in text
    assert "140.0 MB per round, 280 MB/s" in text
    assert "70.0 MB/s (median)" in text
    assert "**In the store** 2.00 s (1.50, 2.50) after" in text
    assert "5,600-token system prompt" in text


def test_report_of_one_round_lists_no_rounds_and_a_missing_fetch_header():
    run = {"started": "s", "weed": "4.48", "answer_tokens": 1,
           "load": {"before": {"cores": 2, "cpu": "c", "loadavg": [1.0, 1.0, 1.0]},
                    "after": {"cores": 2, "cpu": "c", "loadavg": [1.0, 1.0, 1.0]}},
           "rounds": [a_round(2.0, 1.0, 60.0, 1.5, None)]}
    text = store.report(run)
    assert "| 2.00 s | - |" in text and "(2.00" not in text
