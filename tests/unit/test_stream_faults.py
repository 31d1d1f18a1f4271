"""A stream that breaks (llama-server killed) or is cut at shutdown ends with an error event
in the client's own format, and the slot is free afterwards (llama-server stubbed)."""
from __future__ import annotations

import io
import json

import pytest
import requests
import responses

from kvproxy import create_app
from kvproxy.relay import answer as relay
from kvproxy.upstream.llama import UpstreamUnavailable, sse_events
from tests.fake_llama import UPSTREAM, FakeLlama

CHUNK = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "tok "}}]}


class KilledMidStream(io.RawIOBase):
    """llama-server's socket: two events, then the connection is reset."""

    def __init__(self, events: int = 2):
        super().__init__()
        self.data = b"".join(f"data: {json.dumps(CHUNK)}\n\n".encode() for _ in range(events))

    def readable(self):
        return True

    def readinto(self, buffer):
        if not self.data:
            raise ConnectionResetError(104, "Connection reset by peer")
        n = min(len(buffer), len(self.data))
        buffer[:n], self.data = self.data[:n], self.data[n:]
        return n


@pytest.fixture
def app_and_fake(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 2})
        yield app, fake, mock


STREAMS = {
    "ollama": ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    "openai": ("/v1/chat/completions",
               {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    "anthropic": ("/v1/messages", {"model": "m", "max_tokens": 50, "stream": True,
                                   "messages": [{"role": "user", "content": "hi"}]}),
}


def last_error(api: str, text: str) -> tuple[int | str, str]:
    """The final event of a stream, which must be an error in the API's own shape."""
    if api == "ollama":
        last = json.loads(text.strip().splitlines()[-1])
        assert set(last) == {"error"} and isinstance(last["error"], str)
        return "ollama", last["error"]
    events = [block for block in text.split("\n\n") if block.strip()]
    last = events[-1]
    if api == "openai":
        error = json.loads(last.removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error["code"], error["message"]
    assert last.startswith("event: error\n")
    error = json.loads(last.split("data: ", 1)[1])
    assert error["type"] == "error"
    return error["error"]["type"], error["error"]["message"]


def slot_is_free(app) -> bool:
    return not app.extensions["kvproxy.switch"].lock.held_here()


@pytest.mark.parametrize("api", STREAMS)
def test_llama_server_killed_mid_stream_is_an_upstream_error_event(app_and_fake, api):
    app, _fake, mock = app_and_fake
    mock.replace(responses.POST, f"{UPSTREAM}/v1/chat/completions", body=io.BufferedReader(KilledMidStream()),
                 content_type="text/event-stream", auto_calculate_content_length=False)
    client = app.test_client()
    path, body = STREAMS[api]
    reply = client.post(path, json=body)
    assert reply.status_code == 200
    text = reply.get_data(as_text=True)
    kind, message = last_error(api, text)
    assert "llama-server" in message and "internal error" not in message
    assert kind in ("ollama", 502, "api_error")
    assert slot_is_free(app)


def test_sse_events_turns_a_broken_connection_into_upstream_unavailable():
    class Broken:
        def iter_lines(self, chunk_size=None):
            yield b"data: {}"
            raise requests.exceptions.ChunkedEncodingError("Connection broken")

    events = sse_events(Broken())
    assert next(events)[1] == {}
    with pytest.raises(UpstreamUnavailable):
        next(events)


@pytest.mark.parametrize("api", STREAMS)
def test_a_stream_past_the_shutdown_grace_ends_with_an_error_event(app_and_fake, api,
                                                                   monkeypatch):
    app, _fake, _mock = app_and_fake
    monkeypatch.setattr(relay, "_stop_at", [])
    client = app.test_client()
    path, body = STREAMS[api]
    relay.begin_shutdown(0)
    reply = client.post(path, json=body)
    kind, message = last_error(api, reply.get_data(as_text=True))
    assert "kvproxy is shutting down: the answer was cut short; send the request again" in message
    assert kind in ("ollama", 503, "overloaded_error")
    assert slot_is_free(app)


def test_the_shutdown_grace_starts_once_and_ends_at_its_deadline(monkeypatch):
    """Streams may run ``grace`` seconds after SIGTERM, from the first signal on."""
    clock = [100.0]
    monkeypatch.setattr(relay, "_stop_at", [])
    monkeypatch.setattr(relay, "time", type("Clock", (), {"monotonic": lambda: clock[0]}))
    assert not relay.past_shutdown_grace()
    relay.begin_shutdown(30)
    relay.begin_shutdown(0)                     # a second signal does not shorten the grace
    clock[0] = 129.9
    assert not relay.past_shutdown_grace()
    clock[0] = 130.0
    assert relay.past_shutdown_grace()
