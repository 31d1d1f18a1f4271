"""Silent and trickling clients under gunicorn: they never hold the worker's threads, the
operator endpoints and chats keep answering, and they are closed after
KVPROXY_RECEIVE_TIMEOUT; a 413 closes its connection (kvproxy.web.worker)."""
from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest
import requests

from tests.conftest import Stack

pytestmark = pytest.mark.real

THREADS = 32
RECEIVE_TIMEOUT = 30


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("slow-clients"), KVPROXY_THREADS=str(THREADS),
              KVPROXY_RECEIVE_TIMEOUT=str(RECEIVE_TIMEOUT), KVPROXY_MAX_BODY_MB="1").start()
    yield s
    s.stop()


def connect(stack: Stack, first_bytes: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", stack.proxy.port), timeout=10)
    sock.sendall(first_bytes)
    return sock


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_slow_and_silent_clients_hold_no_thread(stack):
    url = stack.url
    silent = [connect(stack, b"GET /health HTTP/1.1\r\nHo") for _ in range(THREADS)]
    trickling = [connect(stack, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
                 for _ in range(THREADS)]
    opened = time.monotonic()
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.5):
            for sock in trickling:
                try:
                    sock.send(b" ")
                except OSError:
                    pass

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        time.sleep(1)
        latencies = []
        for path in ("/health", "/metrics", "/api/sessions", "/health", "/health"):
            started = time.monotonic()
            assert requests.get(url + path, timeout=5).status_code == 200, path
            latencies.append(time.monotonic() - started)
        print(f"operator endpoints with {2 * THREADS} slow sockets open: "
              f"{', '.join(f'{t * 1000:.0f} ms' for t in latencies)}")
        assert max(latencies) < 1, latencies

        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60, max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "Say hi."}],
            extra_headers={"X-Session-Id": "among-slow-sockets"})
        assert reply.headers["X-KVProxy-Session"] == "among-slow-sockets"
        assert time.monotonic() - opened < RECEIVE_TIMEOUT, "answered while they were open"

        # kvproxy closes them once the bound has passed, not before.
        assert not closed_by_server(silent[0], 0.1)
        deadline = opened + RECEIVE_TIMEOUT + 5
        for sock in silent + trickling:
            assert closed_by_server(sock, max(0.1, deadline - time.monotonic())), \
                "a slow client was still connected after KVPROXY_RECEIVE_TIMEOUT"
        print(f"closed after {time.monotonic() - opened:.1f} s "
              f"(KVPROXY_RECEIVE_TIMEOUT={RECEIVE_TIMEOUT})")
    finally:
        stop.set()
        trickler.join(5)
        for sock in silent + trickling:
            sock.close()
    assert requests.get(url + "/health", timeout=5).status_code == 200


def test_a_whole_request_sent_slowly_within_the_bound_is_served(stack):
    body = json.dumps({"messages": [{"role": "user", "content": "Say hi."}],
                       "max_tokens": 2}).encode()
    sock = connect(stack, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    with sock:
        for piece in (b"Content-Type: application/json\r\n",
                      f"Content-Length: {len(body)}\r\n\r\n".encode(), body[:10], body[10:]):
            time.sleep(0.5)
            sock.sendall(piece)
        sock.settimeout(60)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


def read_reply(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """Everything the server sends within ``within`` seconds, and whether it then closed."""
    data = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_413_closes_the_connection(stack, framing):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n")
    if framing == "length":   # refused from the header; the body is never sent
        request = head + f"Content-Length: {3 * 1024 * 1024}\r\n\r\n".encode() + b"{"
    else:                     # refused once the bound is passed; the client sends no more
        chunk = b"x" * (1024 * 1024 + 64 * 1024)
        request = head + b"Transfer-Encoding: chunked\r\n\r\n" + \
            f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sock = socket.create_connection(("127.0.0.1", stack.proxy.port), timeout=10)
    with sock:
        sock.sendall(request)
        reply, closed = read_reply(sock, 3)
    head_text = reply.split(b"\r\n\r\n")[0].decode().lower()
    assert head_text.startswith("http/1.1 413"), reply[:300]
    assert "connection: close" in head_text.splitlines()
    assert closed, "kvproxy kept the connection open after its 413"
