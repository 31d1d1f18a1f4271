"""No request holds the slot longer than its client stays or its work can take: a whole
answer's upstream request is closed when its client leaves, and work that cannot fit (too
many messages, more text than the slot's context) is refused before the slot is taken."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import responses

from kvproxy import create_app
from kvproxy.errors import ClientGone
from kvproxy.upstream.llama import LlamaClient
from tests.fake_llama import UPSTREAM
from tests.support import error_shaped

CHAT = f"{UPSTREAM}/v1/chat/completions"


class SlowServer:
    """A server that reads a request and never answers; it notes when its client hangs up."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.hung_up = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(30)
        with conn:
            try:
                while conn.recv(65536):
                    pass
            except OSError:
                pass
            self.hung_up.set()

    def close(self) -> None:
        self.listener.close()


def test_a_whole_answer_whose_client_left_closes_the_upstream_request():
    server = SlowServer()
    client = LlamaClient(f"http://127.0.0.1:{server.port}", read_timeout=30)
    gone_at = time.monotonic() + 0.5
    started = time.monotonic()
    try:
        with pytest.raises(ClientGone):
            client.post_json("/v1/chat/completions", {"messages": []},
                             still_wanted=lambda: time.monotonic() < gone_at)
        assert time.monotonic() - started < 2, "the request outlived its client"
        assert server.hung_up.wait(2), "llama-server never saw the connection close"
    finally:
        server.close()


def test_one_thread_watches_every_call_and_a_failing_question_spoils_none():
    servers = [SlowServer(), SlowServer()]
    asked = []

    def fails_once_then_gone() -> bool:
        asked.append(1)
        if len(asked) == 1:
            raise RuntimeError("a broken check")
        return False

    checks = [fails_once_then_gone, lambda: False]
    outcomes: list = []

    def call(server, still_wanted):
        client = LlamaClient(f"http://127.0.0.1:{server.port}", read_timeout=30)
        try:
            client.post_json("/v1/chat/completions", {"messages": []}, still_wanted=still_wanted)
        except ClientGone as exc:
            outcomes.append(exc)

    callers = [threading.Thread(target=call, args=pair, daemon=True)
               for pair in zip(servers, checks)]
    try:
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(5)
        assert len(outcomes) == 2, "both calls were cut once their clients were gone"
        assert all(server.hung_up.wait(2) for server in servers)
        watchers = [t for t in threading.enumerate() if t.name == "kvproxy-client-watch"]
        assert len(watchers) == 1
    finally:
        for server in servers:
            server.close()


def test_a_client_that_stays_keeps_its_request():
    with responses.RequestsMock() as mock:
        mock.add(responses.POST, CHAT, json={"choices": []})
        client = LlamaClient(UPSTREAM)
        assert client.post_json("/v1/chat/completions", {}, still_wanted=lambda: True) == \
            {"choices": []}


def app_for(tmp_path, **settings):
    return create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 0.5,
                       "base_snapshots": False, **settings})


def bodies(api: str, messages: list[dict]) -> tuple[str, dict]:
    if api == "openai":
        return "/v1/chat/completions", {"messages": messages, "stream": False}
    if api == "anthropic":
        return "/v1/messages", {"model": "m", "max_tokens": 5, "messages": messages}
    return "/api/chat", {"model": "tiny", "messages": messages, "stream": False}


@pytest.mark.parametrize("api", ["openai", "anthropic", "ollama"])
def test_too_many_messages_are_refused_before_the_slot(tmp_path, fake, api):
    app = app_for(tmp_path, max_messages=100)
    switch = app.extensions["kvproxy.switch"]
    taken = []
    original = switch.acquire
    switch.acquire = lambda *a, **k: taken.append(1) or original(*a, **k)
    messages = [{"role": "user" if n % 2 == 0 else "assistant", "content": "x"}
                for n in range(101)]
    path, body = bodies(api, messages)
    reply = app.test_client().post(path, json=body)
    assert reply.status_code == 400, reply.get_data(as_text=True)
    assert error_shaped(api, reply.get_json())
    assert "KVPROXY_MAX_MESSAGES" in reply.get_data(as_text=True)
    assert not taken, "the slot was taken for work that was refused"
    path, body = bodies(api, messages[:99])
    assert app.test_client().post(path, json=body).status_code == 200


@pytest.mark.parametrize("api", ["openai", "anthropic", "ollama"])
def test_text_that_cannot_fit_the_context_is_refused_before_the_slot(tmp_path, fake, api):
    app = app_for(tmp_path)  # the stub's slots have 8192 tokens: 262,144 characters at 32
    switch = app.extensions["kvproxy.switch"]
    taken = []
    original = switch.acquire
    switch.acquire = lambda *a, **k: taken.append(1) or original(*a, **k)
    path, body = bodies(api, [{"role": "user", "content": "word " * 60000}])
    reply = app.test_client().post(path, json=body)
    assert reply.status_code == 400, reply.get_data(as_text=True)
    assert error_shaped(api, reply.get_json())
    assert "exceeds the available context size" in reply.get_data(as_text=True)
    assert not taken
    path, body = bodies(api, [{"role": "user", "content": "word " * 40000}])
    assert app.test_client().post(path, json=body).status_code == 200
