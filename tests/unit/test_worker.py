"""The gunicorn worker's pieces without gunicorn: when a gathered request is complete, the
deadline on the rest of a body, and the 408 it becomes (kvproxy.web.worker)."""
from __future__ import annotations

import io
import socket
import time

import pytest

from kvproxy import create_app
from kvproxy.errors import ReceiveTimeout
from kvproxy.web import worker
from kvproxy.web.worker import GATHER_BYTES, _Deadline, _DeadlineSocket, request_complete
from tests.fake_llama import UPSTREAM

LIMIT = 64 * 1024 * 1024
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"


@pytest.mark.parametrize("data, complete", [
    (b"GET /health HTTP/1.1\r\nHo", False),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", True),
    (b"GET /health HTTP/1.1\nHost: x\n\n", True),
    (HEAD + b"Content-Length: 10\r\n\r\n{", False),
    (HEAD + b"Content-Length: 10\r\n\r\n0123456789", True),
    (HEAD + b"content-length:  10 \r\n\r\n0123", False),
    (HEAD + b"Content-Length: 99999999999\r\n\r\n", True),      # 413 without reading
    (HEAD + b"Content-Length: nonsense\r\n\r\n", True),         # gunicorn refuses it
    (HEAD + b"Expect: 100-continue\r\nContent-Length: 10\r\n\r\n", True),
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", False),
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", True),
    (HEAD + f"Content-Length: {2 * GATHER_BYTES}\r\n\r\n".encode() + b"x" * GATHER_BYTES, True),
    (b"GET / HTTP/1.1\r\nX: " + b"y" * (300 * 1024), True),    # gunicorn refuses it
])
def test_when_a_gathered_request_is_complete(data, complete):
    assert request_complete(bytearray(data), LIMIT) is complete


def test_the_rest_of_a_body_is_read_under_the_deadline(monkeypatch):
    monkeypatch.setattr(worker, "MIN_RATE", 10)           # a second per 10 bytes received
    ours, client = socket.socketpair()
    with ours, client:
        deadline = _Deadline(0.3)
        sock = _DeadlineSocket(ours, deadline)
        client.sendall(b"0123456789")
        before = deadline.left()
        assert sock.recv(100) == b"0123456789"
        assert deadline.left() > before + 0.9, "bytes received extend the deadline"
        assert ours.gettimeout() is None, "the reply is written to a blocking socket"
        started = time.monotonic()
        with pytest.raises(ReceiveTimeout):
            sock.recv(100)                                 # the client sends nothing more
        assert 1 < time.monotonic() - started < 2
        with pytest.raises(ReceiveTimeout):
            sock.recv(100)                                 # past the deadline: at once


class Silent(io.RawIOBase):
    def readable(self):
        return True

    def readinto(self, buffer):
        raise ReceiveTimeout()


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"),
                                         ("/api/chat", "ollama"),
                                         ("/v1/messages", "anthropic")])
def test_a_body_that_did_not_arrive_is_a_408_that_closes(fake, tmp_path, path, shape):
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM})
    reply = app.test_client().post(path, content_type="application/json", environ_overrides={
        "wsgi.input": Silent(), "CONTENT_LENGTH": "100"})
    assert reply.status_code == 408
    assert reply.headers["Connection"] == "close"
    body = reply.get_json()
    message = {"openai": lambda: body["error"]["message"], "ollama": lambda: body["error"],
               "anthropic": lambda: body["error"]["message"]}[shape]()
    assert "KVPROXY_RECEIVE_TIMEOUT" in message


def test_worker_exit_saves_the_slots_through_the_wrapped_app(monkeypatch):
    """ReceivingWorker.load_wsgi wraps the app; the shutdown save (gunicorn_conf.worker_exit)
    must still find its switches, or a restart loses every turn not saved behind yet."""
    from types import SimpleNamespace

    from gunicorn.workers.base import Worker

    from kvproxy import gunicorn_conf

    saved = []
    switch = SimpleNamespace(checkpoint=lambda: saved.append("checkpoint"))
    models = SimpleNamespace(switches=lambda: [switch])

    def app(environ, start_response):
        return []
    app.extensions = {"kvproxy.models": models}
    monkeypatch.setattr(Worker, "load_wsgi", lambda self: setattr(self, "wsgi", app))
    receiving = worker.ReceivingWorker.__new__(worker.ReceivingWorker)
    receiving._serving = __import__("threading").local()
    receiving.load_wsgi()
    assert receiving.wsgi is not app   # wrapped, to keep the app's Connection: close
    gunicorn_conf.worker_exit(None, receiving)
    assert saved == ["checkpoint"]
