"""No request holds the slot longer than its client stays or its work can take, against the
real llama-server and kvproxy under gunicorn: a whole answer whose client left frees the slot
within seconds, and a body of 40,000 messages is refused before it takes the slot."""
from __future__ import annotations

import json
import socket
import time

import pytest
import requests

pytestmark = pytest.mark.real


def llama_busy(stack) -> bool:
    slots = requests.get(stack.llama.url + "/slots", timeout=10).json()
    return any(slot.get("is_processing") for slot in slots)


def short_chat(stack, session: str, timeout: float = 120) -> float:
    started = time.monotonic()
    reply = requests.post(stack.url + "/v1/chat/completions", timeout=timeout,
                          headers={"X-Session-Id": session},
                          json={"messages": [{"role": "user", "content": "Say hi."}],
                                "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    return time.monotonic() - started


def test_a_whole_answer_whose_client_left_frees_the_slot(stack):
    short_chat(stack, "warm-up")
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a very long story."}],
                       "max_tokens": 6000, "ignore_eos": True, "stream": False}).encode()
    sock = socket.create_connection(("127.0.0.1", stack.proxy.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nX-Session-Id: leaver\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while not llama_busy(stack):     # the long answer is being generated
        assert time.monotonic() < deadline, "the long answer never started"
        time.sleep(0.5)
    time.sleep(2)
    sock.close()
    # No polling of llama-server from here: each answer it sends wakes its HTTP threads, and
    # a request's closed connection is only noticed after a second without any answer.
    left = time.monotonic()
    took = short_chat(stack, "next", timeout=60)
    freed = time.monotonic() - left
    print(f"the next chat ({took:.2f} s) was answered {freed:.2f} s after the client left")
    # On an idle machine about 2 s; the long answer alone would take minutes.
    assert freed < 20, f"the next chat waited {freed:.1f} s for the slot"
    assert "cancel task" in (stack.log_dir / "llama-server.log").read_text(errors="replace")
    assert "client of session leaver left before its answer was ready" in stack.proxy_log()


@pytest.mark.parametrize("path,make", [
    ("/v1/chat/completions", lambda m, _name: {"messages": m, "max_tokens": 4}),
    ("/v1/messages", lambda m, _name: {"model": "m", "max_tokens": 4, "messages": m}),
    ("/api/chat", lambda m, name: {"model": name, "messages": m, "stream": False}),
], ids=["openai", "anthropic", "ollama"])
def test_forty_thousand_messages_are_refused_at_once(stack, path, make):
    messages = [{"role": "user" if n % 2 == 0 else "assistant", "content": "x"}
                for n in range(40000)]
    name = requests.get(stack.url + "/api/tags", timeout=10).json()["models"][0]["name"]
    started = time.monotonic()
    reply = requests.post(stack.url + path, json=make(messages, name), timeout=120)
    refused = time.monotonic() - started
    print(f"{path}: 40,000 messages refused in {refused:.2f} s")
    assert reply.status_code == 400, reply.text[:300]
    assert refused < 5, f"refused after {refused:.1f} s"
    body = reply.json()
    if path == "/v1/chat/completions":
        assert body["error"]["type"] == "invalid_request_error"
        assert "KVPROXY_MAX_MESSAGES" in body["error"]["message"]
    elif path == "/v1/messages":
        assert body["type"] == "error" and "KVPROXY_MAX_MESSAGES" in body["error"]["message"]
    else:
        assert "KVPROXY_MAX_MESSAGES" in body["error"]
    assert not llama_busy(stack)
    slots = requests.get(stack.url + "/api/slots", timeout=10).json()
    assert not any(row.get("busy") for row in slots), slots
    assert short_chat(stack, "after-refusal") < 30
