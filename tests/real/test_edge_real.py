"""Hostile ids, bounded bodies, llama-server killed mid-stream and a graceful stop, against
the real llama-server and kvproxy under gunicorn."""
from __future__ import annotations

import json
import signal
import time

import anthropic
import pytest
import requests

from conftest import Stack
from kvproxy.storage.store import SessionStore
from kvproxy.sessions.identity import client_key, file_stem, model_tag, normalise_id, on_model

pytestmark = pytest.mark.real

STOP_GRACE = 3


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("edge"), KVPROXY_MAX_BODY_MB="1",
              KVPROXY_STOP_GRACE=str(STOP_GRACE), KVPROXY_LOCK_TIMEOUT="60").start()
    yield s
    s.stop()


def answered_at_once(url: str) -> None:
    """The slot is free: a plain request is served without waiting for a lock."""
    started = time.monotonic()
    reply = requests.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert time.monotonic() - started < 30


# -- hostile ids ------------------------------------------------------------------------------
def test_the_issue_reproducer(edge):
    raw = (b'{"model":"m","max_tokens":2,"metadata":{"user_id":"\\ud800"},'
           b'"messages":[{"role":"user","content":"hi"}]}')
    reply = requests.post(edge.url + "/v1/messages", data=raw, timeout=60,
                          headers={"content-type": "application/json", "x-api-key": "k"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["type"] == "message"
    assert reply.headers["X-KVProxy-Session"] == r"\ud800"
    answered_at_once(edge.url)


@pytest.mark.parametrize("user_id", ["line\nbreak\x07", "a\u2028b", "x" * 20000, "default",
                                     "conv-0123456789abcdef"])
def test_real_anthropic_client_with_hostile_metadata(edge, user_id):
    client = anthropic.Anthropic(base_url=edge.url, api_key="k", max_retries=0, timeout=120)
    raw = client.messages.with_raw_response.create(
        model="m", max_tokens=2, metadata={"user_id": user_id},
        messages=[{"role": "user", "content": "hi"}])
    assert raw.parse().type == "message"
    shown = raw.headers["x-kvproxy-session"]
    assert shown.isascii() and shown.isprintable() and len(shown) < 400
    from urllib.parse import unquote
    assert unquote(shown) == normalise_id(user_id)
    log = edge.proxy_log()
    assert "\n" not in normalise_id(user_id) and "Logging error" not in log
    metrics = requests.get(edge.url + "/metrics", timeout=10).text
    samples = "\n".join(line for line in metrics.splitlines() if not line.startswith("#"))
    assert user_id[:12] not in samples
    assert 'kvproxy_active_session{kind="client",persistent="true"} 1.0' in samples
    answered_at_once(edge.url)


# -- bounded bodies ---------------------------------------------------------------------------
def test_large_bodies_get_413_in_their_format_through_gunicorn(edge):
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (3 * 1024 * 1024) + b'"}]}'
    reply = requests.post(edge.url + "/v1/chat/completions", data=big, timeout=60,
                          headers={"content-type": "application/json"})
    assert reply.status_code == 413
    assert "KVPROXY_MAX_BODY_MB" in reply.json()["error"]["message"]

    def chunks():  # no Content-Length: sent chunked
        yield b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "'
        for _ in range(48):
            yield b"y" * 65536
        yield b'"}]}'

    reply = requests.post(edge.url + "/v1/messages", data=chunks(), timeout=60,
                          headers={"content-type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["type"] == "request_too_large"
    blob = requests.post(edge.url + "/api/blobs/sha256:" + "0" * 64, data=b"g" * 500_000,
                         timeout=60)
    assert blob.status_code == 400 and "serves the one model" in blob.json()["error"]
    answered_at_once(edge.url)


# -- llama-server killed mid-stream -----------------------------------------------------------
LONG = "Count from 1 to 300, one number per line."


def streamed(api: str, url: str, session: str) -> requests.Response:
    headers = {"X-Session-Id": session}
    if api == "openai":
        body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2000,
                "stream": True, "ignore_eos": True}
        path = "/v1/chat/completions"
    elif api == "anthropic":
        body = {"model": "m", "max_tokens": 2000, "stream": True,
                "messages": [{"role": "user", "content": LONG}]}
        path = "/v1/messages"
    else:
        name = requests.get(url + "/api/tags", timeout=10).json()["models"][0]["name"]
        body = {"model": name, "messages": [{"role": "user", "content": LONG}],
                "options": {"num_predict": 2000}}
        path = "/api/chat"
    reply = requests.post(url + path, json=body, headers=headers, stream=True, timeout=(5, 120))
    assert reply.status_code == 200
    return reply


def has_text(api: str, line: bytes) -> bool:
    if api == "ollama":
        return bool(json.loads(line).get("message", {}).get("content"))
    if not line.startswith(b"data: ") or line.endswith(b"[DONE]"):
        return False
    event = json.loads(line[6:])
    if api == "anthropic":
        return event.get("type") == "content_block_delta"
    return any((c.get("delta") or {}).get("content") for c in event.get("choices") or [])


def read_until_text(api: str, lines) -> None:
    for line in lines:
        if line and has_text(api, line):
            return
    pytest.fail("the stream ended before any text")


def final_error(api: str, rest: list[bytes]) -> tuple[str, str]:
    lines = [line for line in rest if line.strip()]
    if api == "ollama":
        last = json.loads(lines[-1])
        assert set(last) == {"error"}
        return "ollama", last["error"]
    if api == "openai":
        error = json.loads(lines[-1].removeprefix(b"data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error["type"], error["message"]
    assert lines[-2] == b"event: error"
    error = json.loads(lines[-1].removeprefix(b"data: "))
    return error["error"]["type"], error["error"]["message"]


@pytest.mark.parametrize("api", ["openai", "anthropic", "ollama"])
def test_llama_server_killed_mid_stream(edge, api):
    session = f"killed-{api}"
    first = requests.post(edge.url + "/v1/chat/completions", headers={"X-Session-Id": session},
                          timeout=120, json={"messages": [{"role": "user", "content": LONG}],
                                             "max_tokens": 4})
    assert first.status_code == 200  # the slot now holds this session's tokens
    reply = streamed(api, edge.url, session)
    lines = reply.iter_lines()
    read_until_text(api, lines)
    edge.llama.process.kill()
    edge.llama.process.wait(10)
    rest = list(lines)  # the stream must end, with an error event as its last word
    kind, message = final_error(api, rest)
    assert "llama-server" in message and "internal error" not in message, message
    assert kind in ("ollama", "upstream_error", "api_error"), kind
    edge.llama.start()
    again = requests.post(edge.url + "/v1/chat/completions", headers={"X-Session-Id": session},
                          timeout=120, json={"messages": [{"role": "user", "content": LONG}],
                                             "max_tokens": 4})
    assert again.status_code == 200, again.text
    assert again.headers["X-KVProxy-Cache"] != "hit", "kvproxy must see the slot is empty"
    answered_at_once(edge.url)


# -- graceful stop ----------------------------------------------------------------------------
def test_sigterm_ends_a_long_stream_and_saves_the_session(edge):
    session = "stopping-1"
    reply = streamed("openai", edge.url, session)
    lines = reply.iter_lines()
    read_until_text("openai", lines)
    stopped_at = time.time()
    edge.proxy.process.send_signal(signal.SIGTERM)
    rest = list(lines)
    ended = time.time() - stopped_at
    kind, message = final_error("openai", rest)
    assert "shutting down" in message and kind == "server_busy"
    assert ended < STOP_GRACE + 15, f"the stream took {ended:.1f} s to end"
    edge.proxy.process.wait(40)
    try:
        stem = on_model(file_stem(client_key(session)), model_tag(edge.llama.model))
        sidecar = json.loads((edge.slot_dir / f"{stem}.json").read_text())
        assert sidecar.get("n_tokens", 0) > 20, "the conversation's tokens were saved at shutdown"
        assert SessionStore(edge.slot_dir).bin_bytes(stem) == sidecar["n_bytes"]
    finally:
        edge.start_proxy()  # the later tests of this module use the same stack
    back = requests.post(edge.url + "/v1/chat/completions", headers={"X-Session-Id": session},
                         timeout=120, json={"messages": [{"role": "user", "content": LONG}],
                                            "max_tokens": 2})
    assert back.status_code == 200
    assert back.json()["timings"]["cache_n"] > 10


# -- input llama-server cannot use ------------------------------------------------------------
@pytest.mark.parametrize("body", [
    {"messages": [{"role": 5, "content": "a"}]},                       # llama-server: 500
    {"messages": [{"role": "user", "content": "a"}], "tools": "x"},    # llama-server: 500
    {"messages": [{"role": "user", "content": 5}]},                    # llama-server: 400
    {"messages": [{"role": "user", "content": "a"}], "temperature": float("nan")},
])
def test_unusable_input_is_a_400_in_openai_shape(edge, body):
    data = json.dumps({**body, "max_tokens": 1}).encode()
    reply = requests.post(edge.url + "/v1/chat/completions", data=data, timeout=60,
                          headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    answered_at_once(edge.url)
