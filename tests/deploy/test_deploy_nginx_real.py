"""One machine: the shipped deploy/nginx/kvproxy.conf in front of a real kvproxy and
llama-server, driven by the real ollama, openai and anthropic clients.

Only the addresses of the shipped site are changed (tests/nginx_harness.py). Controls
render the same site with one directive changed, to show the tests see what the shipped
value prevents.
"""
from __future__ import annotations

import statistics
import time

import anthropic
import ollama
import openai
import pytest
import requests

from tests.nginx_harness import Nginx, light_stack, session_from

pytestmark = [pytest.mark.real, pytest.mark.deploy]

COUNT = "Count from 1 to 60, separated by commas."
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    pair = light_stack(tmp_path_factory.mktemp("stack")).start()
    yield pair
    pair.stop()


@pytest.fixture(scope="module")
def nginx(stack, tmp_path_factory):
    with Nginx(tmp_path_factory.mktemp("nginx"), "kvproxy.conf",
               [f"127.0.0.1:{stack.proxy.port}"]) as server:
        yield server


def stream_openai(url: str, session: str) -> list[float]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    started, times = time.perf_counter(), []
    for chunk in client.chat.completions.create(
            model="any", max_tokens=MAX_TOKENS, temperature=0, stream=True,
            messages=[{"role": "user", "content": COUNT}],
            extra_headers={"X-Session-Id": session}):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter() - started)
    return times


def stream_ollama(url: str, session: str) -> list[float]:
    client = ollama.Client(host=url, timeout=120, headers={"X-OpenWebUI-Chat-Id": session})
    model = client.list().models[0].model
    started, times = time.perf_counter(), []
    for part in client.chat(model=model, messages=[{"role": "user", "content": COUNT}],
                            stream=True, options={"num_predict": MAX_TOKENS, "temperature": 0}):
        if part.message.content:
            times.append(time.perf_counter() - started)
    return times


def stream_anthropic(url: str, session: str) -> list[float]:
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120,
                                 default_headers={"X-Claude-Code-Session-Id": session})
    started, times = time.perf_counter(), []
    with client.messages.stream(model="any", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": COUNT}]) as stream:
        for text in stream.text_stream:
            if text:
                times.append(time.perf_counter() - started)
    return times


STREAMERS = {"openai": stream_openai, "ollama": stream_ollama, "anthropic": stream_anthropic}


def describe(times: list[float]) -> dict:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"chunks": len(times), "first_s": round(times[0], 3), "last_s": round(times[-1], 3),
            "median_gap_ms": round(statistics.median(gaps) * 1000, 1),
            "spread_gaps": sum(gap >= 0.003 for gap in gaps) / len(gaps)}


def assert_streamed_live(figures: dict) -> None:
    """Chunks came one by one as produced: most arrived apart from the one before (a
    buffered answer arrives in a few bursts)."""
    assert figures["chunks"] >= 10, figures
    assert figures["spread_gaps"] >= 0.5, figures


def window_s(figures: dict) -> float:
    """From the first chunk to the last: how long the answer took to arrive once it began
    (the wait before it, e.g. for another conversation's slot keep, is not streaming)."""
    return figures["last_s"] - figures["first_s"]


@pytest.mark.parametrize("api", list(STREAMERS))
def test_streamed_chunks_arrive_as_produced(stack, nginx, api):
    stream = STREAMERS[api]
    direct = describe(stream(stack.url, f"direct-{api}"))
    through = describe(stream(nginx.url, f"nginx-{api}"))
    print(f"\n{api}: direct {direct}\n{api}: nginx  {through}")
    assert_streamed_live(direct)
    assert_streamed_live(through)
    # Spread over about as long as the same answer took without nginx: held back and sent
    # at the end, it would arrive within a few milliseconds.
    assert window_s(through) >= 0.3 * window_s(direct), (direct, through)


def test_control_nginx_defaults_deliver_in_bursts(stack, tmp_path):
    """The same site with nginx's defaults for the upstream (HTTP/1.0, buffering on) and
    kvproxy's X-Accel-Buffering ignored: the chunks come in bursts and the check above
    fails, so it really tells a live stream from a buffered one. (With HTTP/1.1 nginx passes
    each chunk of a chunked reply on even with buffering on; the site sets both.)"""
    overrides = {"proxy_http_version": "1.0",
                 "proxy_buffering": "on; proxy_ignore_headers X-Accel-Buffering"}
    with Nginx(tmp_path, "kvproxy.conf", [f"127.0.0.1:{stack.proxy.port}"], overrides) as buffered:
        figures = describe(stream_openai(buffered.url, "buffered"))
    print(f"\nnginx defaults (control): {figures}")
    assert figures["spread_gaps"] < 0.5, figures
    with pytest.raises(AssertionError):
        assert_streamed_live(figures)


@pytest.mark.parametrize("header", ["X-Session-Id", "X-OpenWebUI-Chat-Id",
                                    "X-Claude-Code-Session-Id"])
def test_session_headers_reach_kvproxy(nginx, header):
    reply = requests.post(nginx.url + "/v1/chat/completions", timeout=120,
                          headers={header: f"chat-{header.lower()}"},
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert reply.status_code == 200
    assert reply.headers["X-KVProxy-Session"] == f"chat-{header.lower()}"
    assert reply.headers["X-KVProxy-Node"]


def test_admin_api_only_from_this_machine(nginx):
    local_only = ["/api/sessions", "/api/sessions/current", "/api/slots", "/api/status", "/status",
                  "/slots"]
    assert [requests.get(nginx.url + p, timeout=30).status_code for p in local_only] == [200] * 6
    with session_from("127.0.0.2") as elsewhere:
        assert [elsewhere.get(nginx.url + p, timeout=30).status_code for p in local_only] == [403] * 6
        for path in ("/health", "/api/tags", "/v1/models"):
            assert elsewhere.get(nginx.url + path, timeout=30).status_code == 200, path


TOO_LARGE = "word " * (13 * 1024 * 1024)     # 65 MiB of text: over the 64 MiB body limit


def test_a_body_over_the_limit_gets_an_error_each_client_shows(nginx):
    """nginx refuses it before kvproxy sees it, in each API's own error shape."""
    messages = [{"role": "user", "content": TOO_LARGE}]
    with pytest.raises(openai.APIStatusError) as caught:
        openai.OpenAI(base_url=nginx.url + "/v1", api_key="x", max_retries=0, timeout=120) \
            .chat.completions.create(model="any", max_tokens=1, messages=messages)
    assert caught.value.status_code == 413 and "larger than 64 MiB" in caught.value.message
    with pytest.raises(anthropic.APIStatusError) as caught:
        anthropic.Anthropic(base_url=nginx.url, api_key="x", max_retries=0, timeout=120) \
            .messages.create(model="any", max_tokens=1, messages=messages)
    assert caught.value.status_code == 413 and "larger than 64 MiB" in caught.value.message
    assert caught.value.body["error"]["type"] == "request_too_large"
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=nginx.url, timeout=120).chat(model="any", messages=messages)
    assert caught.value.status_code == 413 and caught.value.error == "request body larger than 64 MiB"
