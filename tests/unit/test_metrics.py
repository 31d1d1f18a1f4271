"""GET /metrics families, the slot-folder gauges and the one-line request log."""
from __future__ import annotations

import json
import logging
import re

import pytest
import responses
from prometheus_client.parser import text_string_to_metric_families

from kvproxy import create_app
from kvproxy.ops import metrics
from tests.support import sample

UPSTREAM = "http://llama.test"
PROPS = {"model_path": "/models/tiny.gguf", "build_info": "b1-test", "total_slots": 1,
         "default_generation_settings": {"n_ctx": 8192}}
MODELS = {"object": "list", "data": [{"id": "tiny.gguf", "meta": {"size": 1000, "n_params": 135}}]}
TIMINGS = {"cache_n": 3, "prompt_n": 7, "predicted_n": 2, "prompt_ms": 1.0}


def scrape(client) -> dict[str, dict]:
    """``{family: {"type": ..., "samples": {(name, labels...): value}}}`` from GET /metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.mimetype == "text/plain"
    families = {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        families[family.name] = {"type": family.type, "samples": samples}
    return families


@pytest.fixture
def app(tmp_path):
    return create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM})


@pytest.fixture
def upstream():
    """llama-server stubs for one chat request: model facts, slot actions, the answer."""
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.add(responses.GET, f"{UPSTREAM}/props", json=PROPS)
        mock.add(responses.GET, f"{UPSTREAM}/v1/models", json=MODELS)
        mock.add(responses.GET, f"{UPSTREAM}/slots",
                 json=[{"id": 0, "n_ctx": 8192, "is_processing": False}])
        mock.add(responses.GET, f"{UPSTREAM}/health", json={"status": "ok"})
        mock.add(responses.POST, re.compile(rf"{UPSTREAM}/slots/0\?action=erase"),
                 json={"id_slot": 0, "n_erased": 0})
        mock.add(responses.POST, re.compile(rf"{UPSTREAM}/slots/0\?action=save"),
                 json={"id_slot": 0, "n_saved": 12, "n_written": 4096, "timings": {"save_ms": 1}})
        yield mock


def add_chat(mock, stream: bool) -> None:
    if not stream:
        mock.add(responses.POST, f"{UPSTREAM}/v1/chat/completions",
                 json={"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                    "finish_reason": "stop"}], "timings": TIMINGS})
        return
    chunks = [{"choices": [{"index": 0, "delta": {"content": "o"}}]},
              {"choices": [{"index": 0, "delta": {"content": "k"}, "finish_reason": "stop"}],
               "timings": TIMINGS}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    mock.add(responses.POST, f"{UPSTREAM}/v1/chat/completions", body=body,
             content_type="text/event-stream")


def request_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvproxy.requests"]


def fields_of(line: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line))


def test_metrics_exposes_every_family(app):
    families = scrape(app.test_client())
    expected = {
        "kvproxy_requests": "counter", "kvproxy_request_seconds": "histogram",
        "kvproxy_swaps": "counter", "kvproxy_swap_seconds": "histogram",
        "kvproxy_swap_bytes": "counter", "kvproxy_lock_wait_seconds": "histogram",
        "kvproxy_prompt_tokens": "counter", "kvproxy_restore_misses": "counter",
        "kvproxy_evictions": "counter", "kvproxy_evicted_bytes": "counter",
        "kvproxy_slot_dir_bytes": "gauge", "kvproxy_slot_dir_files": "gauge",
        "kvproxy_active_session": "gauge", "kvproxy_slot_tokens": "gauge",
    }
    for name, kind in expected.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name]["type"] == kind, name


def test_slot_dir_bytes_follow_the_files_on_disk(app, tmp_path):
    client = app.test_client()
    assert sample(scrape(client), "kvproxy_slot_dir_bytes") == 0
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "b.bin").write_bytes(b"y" * 234)
    (tmp_path / "a.json").write_text("{}")  # sidecars and state are not slot files
    families = scrape(client)
    assert sample(families, "kvproxy_slot_dir_bytes") == 1234
    assert sample(families, "kvproxy_slot_dir_files") == 2
    (tmp_path / "a.bin").unlink()
    (tmp_path / "b.bin").write_bytes(b"y" * 5000)
    families = scrape(client)
    assert sample(families, "kvproxy_slot_dir_bytes") == 5000
    assert sample(families, "kvproxy_slot_dir_files") == 1


def test_each_app_reports_its_own_folder(tmp_path):
    first = create_app({"slot_dir": str(tmp_path / "one"), "upstream": UPSTREAM})
    second = create_app({"slot_dir": str(tmp_path / "two"), "upstream": UPSTREAM})
    (tmp_path / "one" / "s.bin").write_bytes(b"z" * 10)
    (tmp_path / "two" / "s.bin").write_bytes(b"z" * 20)
    assert sample(scrape(first.test_client()), "kvproxy_slot_dir_bytes") == 10
    assert sample(scrape(second.test_client()), "kvproxy_slot_dir_bytes") == 20


def test_active_session_comes_from_the_state_file(app):
    client = app.test_client()
    assert not [k for k in scrape(client)["kvproxy_active_session"]["samples"]]
    app.extensions["kvproxy.switch"].store.write_state(
        {"active": "conv-abc", "active_persistent": True, "slot_tokens": 42})
    families = scrape(client)
    assert sample(families, "kvproxy_active_session", kind="conversation", persistent="true") == 1
    assert sample(families, "kvproxy_slot_tokens") == 42


def test_a_request_is_counted_and_logged_with_session_and_cache(app, upstream, caplog):
    caplog.set_level(logging.INFO, logger="kvproxy.requests")
    add_chat(upstream, stream=False)
    client = app.test_client()
    before = scrape(client)
    response = client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 200
    session = response.headers["X-KVProxy-Session"]
    lines = [fields_of(line) for line in request_lines(caplog)]
    chat = [f for f in lines if f.get("route") == "/v1/chat/completions"]
    assert len(chat) == 1, lines
    line = chat[0]
    assert line["status"] == "200"
    assert line["session"] == session
    assert line["cache"] == response.headers["X-KVProxy-Cache"] == "miss"
    assert line["streamed"] == "false"
    assert float(line["duration_ms"]) >= 0

    after = scrape(client)
    route = {"route": "/v1/chat/completions", "status": "200"}
    assert (sample(after, "kvproxy_requests", "kvproxy_requests_total", **route)
            == sample(before, "kvproxy_requests", "kvproxy_requests_total", **route) + 1)
    assert (sample(after, "kvproxy_swaps", "kvproxy_swaps_total", kind="erase")
            == sample(before, "kvproxy_swaps", "kvproxy_swaps_total", kind="erase") + 1)
    for kind, n in (("reused", 3), ("computed", 7)):
        assert (sample(after, "kvproxy_prompt_tokens", "kvproxy_prompt_tokens_total", kind=kind)
                == sample(before, "kvproxy_prompt_tokens", "kvproxy_prompt_tokens_total",
                          kind=kind) + n)
    assert sample(after, "kvproxy_active_session", kind="conversation", persistent="true") == 1


def test_metrics_never_show_a_client_id(app, upstream):
    """Ids can be e-mail addresses (OpenAI's ``user``): /metrics labels the kind, not the id."""
    add_chat(upstream, stream=False)
    client = app.test_client()
    response = client.post("/v1/chat/completions",
                           json={"user": "alice@example.com",
                                 "messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 200
    assert response.headers["X-KVProxy-Session"] == "alice@example.com"
    text = client.get("/metrics").get_data(as_text=True)
    assert "alice" not in text and "example.com" not in text
    assert sample(scrape(client), "kvproxy_active_session", kind="client", persistent="true") == 1


@pytest.mark.parametrize("value", ["a\nb", "a\rb\u2028c", "\ud800", "x\x1b[31mred", "é \"q\" \\"])
def test_log_fields_stay_on_one_printable_line(value):
    line = metrics.format_request_line({"session": value, "status": 200})
    assert line.isprintable() and "\n" not in line
    assert line.encode("utf-8")  # no lone surrogate left to crash a log handler
    assert line.endswith(" status=200")


def test_a_streamed_request_is_logged_when_it_closes(app, upstream, caplog):
    caplog.set_level(logging.INFO, logger="kvproxy.requests")
    add_chat(upstream, stream=True)
    client = app.test_client()
    response = client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "stream me"}],
                                 "stream": True})
    assert response.status_code == 200
    assert b"[DONE]" in response.get_data()
    response.close()
    chat = [fields_of(line) for line in request_lines(caplog)
            if "route=/v1/chat/completions" in line]
    assert len(chat) == 1, chat
    assert chat[0]["streamed"] == "true"
    assert chat[0]["session"] == response.headers["X-KVProxy-Session"]
    assert chat[0]["cache"] == response.headers["X-KVProxy-Cache"] == "miss"
    assert float(chat[0]["duration_ms"]) >= 0


def test_log_fields_with_spaces_are_quoted():
    line = metrics.format_request_line({"session": 'a "b" c', "cache": None, "status": 200})
    assert line == 'session="a \\"b\\" c" cache=- status=200'
    assert fields_of(line)["session"] == '"a \\"b\\" c"'


# -- against the real llama-server -------------------------------------------
