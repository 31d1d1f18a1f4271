"""kvproxy's gunicorn worker: gthread, but a request is read before a thread serves it.

gunicorn's gthread worker gives a connection to a thread as soon as it is readable; the
thread then blocks in ``recv`` until the headers are complete, and again while the app
reads the body. A client that sends half a header line and stops, or trickles a body,
holds a thread for as long as it likes: as many such clients as threads, and ``/health``
waits with everyone else. Here the worker's main loop (gunicorn's selector) gathers the
headers and a body of up to ``GATHER_BYTES`` without blocking, and a thread runs the
request only once it is all there. A request must arrive within ``KVPROXY_RECEIVE_TIMEOUT``
seconds of its start (the connection opened, or its first byte on a kept-alive one), plus
a second per ``MIN_RATE`` bytes received, or the connection is closed. The rest of a larger
body is read by the thread under the same deadline (``ReceiveTimeout``, answered 408).

gunicorn also drops a ``Connection: close`` the app sends (hop-by-hop headers are the
server's business under PEP 3333), so a 413 left the connection open for the unread body.
Such a reply here calls gunicorn's own ``Request.force_close``: the reply says
``Connection: close`` and the connection is closed after it.

Connections gunicorn reads itself (TLS, HTTP/2 with prior knowledge) are served as gthread
serves them.
"""
from __future__ import annotations

import re
import selectors
import socket
import threading
import time
from functools import partial

from gunicorn.http2 import negotiation
from gunicorn.workers.gthread import ThreadWorker

from kvproxy.errors import ReceiveTimeout

GATHER_BYTES = 1024 * 1024     # body bytes read in the main loop (nginx's client_body_buffer_size)
HEADER_BYTES = 256 * 1024      # past this without a blank line, gunicorn's parser refuses it
MIN_RATE = 16 * 1024           # bytes a second that keep extending the deadline (128 kbit/s)
_HEADER_END = re.compile(rb"\r?\n\r?\n")


def request_complete(data: bytes | bytearray, body_limit: int) -> bool:
    """Whether ``data`` holds what a thread needs to serve the request without waiting:
    the headers, and the body unless it is larger than ``GATHER_BYTES``, or announced larger
    than ``body_limit`` (the app answers 413 without reading it), or the client waits for
    ``100 Continue``. Anything unusual counts as complete: gunicorn's parser then reads on,
    under the deadline, and refuses what is malformed."""
    end = _HEADER_END.search(data)
    if end is None:
        return len(data) > HEADER_BYTES
    body = len(data) - end.end()
    length, chunked = 0, False
    for line in bytes(data[:end.start()]).split(b"\n")[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            if not value.isdigit():
                return True
            length = int(value)
            if length > body_limit:
                return True
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"expect" and value == b"100-continue":
            return True
    if chunked:
        return body >= GATHER_BYTES or data.endswith(b"0\r\n\r\n")
    return body >= min(length, GATHER_BYTES)


class _Deadline:
    """When a request must have arrived: its start plus the bound, plus a second per
    ``MIN_RATE`` bytes received."""

    def __init__(self, bound: float):
        self.at = time.monotonic() + bound

    def received(self, count: int) -> None:
        self.at += count / MIN_RATE

    def left(self) -> float:
        return self.at - time.monotonic()


class _DeadlineSocket:
    """The socket gunicorn's parser reads the rest of a body from, in the thread: every
    ``recv`` waits at most until the deadline. Writes go to the plain socket."""

    def __init__(self, sock: socket.socket, deadline: _Deadline):
        self._sock, self._deadline = sock, deadline

    def recv(self, size: int) -> bytes:
        left = self._deadline.left()
        if left <= 0:
            raise ReceiveTimeout()
        self._sock.settimeout(left)
        try:
            data = self._sock.recv(size)
        except socket.timeout:
            raise ReceiveTimeout() from None
        finally:
            self._sock.settimeout(None)     # blocking again, for the reply
        self._deadline.received(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self._sock, name)


class ReceivingWorker(ThreadWorker):
    """gthread with requests gathered in the main loop (see the module's text)."""

    def init_process(self):
        self.gathering: set = set()
        self._serving = threading.local()
        super().init_process()

    # -- a request is read in the main loop ----------------------------------------
    def _gathers(self, conn) -> bool:
        return not (self.cfg.is_ssl or conn.is_http2
                    or negotiation.prior_knowledge_allowed(self.cfg, conn.client))

    def enqueue_req(self, conn):
        """Called in the main loop for a new connection, a kept-alive one that became
        readable, or one with the start of its next request already read."""
        if not self._gathers(conn):
            return super().enqueue_req(conn)
        conn.kv_data = bytearray(conn.parser.unreader.take_buffered() if conn.parser else b"")
        conn.kv_deadline = _Deadline(self.receive_timeout)
        conn.sock.setblocking(False)
        if not self._read(conn):
            return
        self.gathering.add(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))

    def _read(self, conn) -> bool:
        """Read what is there; False once the connection is handed on or closed."""
        while not request_complete(conn.kv_data, self.body_limit):
            try:
                chunk = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                chunk = b""
            if not chunk:
                self._drop(conn)
                return False
            conn.kv_data += chunk
            conn.kv_deadline.received(len(chunk))
        self._hand_on(conn)
        return False

    def _on_readable(self, conn, _sock):
        self._read(conn)

    def _forget(self, conn) -> None:
        self.gathering.discard(conn)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _hand_on(self, conn) -> None:
        self._forget(conn)
        conn.sock.setblocking(True)
        super().enqueue_req(conn)

    def _drop(self, conn) -> None:
        self._forget(conn)
        self.nr_conns -= 1
        conn.close()

    def murder_pending(self):
        """Close requests that did not arrive in time (and, when stopping, idle ones)."""
        super().murder_pending()
        for conn in list(self.gathering):
            if conn.kv_deadline.left() <= 0 or (not self.alive and not conn.kv_data):
                self.log.debug("closing a request that did not arrive in time from %s",
                               conn.client)
                self._drop(conn)

    # -- then a thread serves it -----------------------------------------------------
    def handle(self, conn):
        """Hand the gathered bytes to gunicorn's parser; it reads anything more (the rest
        of a large body) under the request's deadline."""
        data, conn.kv_data = getattr(conn, "kv_data", None), None
        if data is None:
            return super().handle(conn)
        conn.init()
        unreader = conn.parser.unreader
        unreader.unread(bytes(data))
        plain = unreader.sock
        unreader.sock = _DeadlineSocket(plain, conn.kv_deadline)
        try:
            return super().handle(conn)
        finally:
            unreader.sock = plain

    def handle_request(self, req, conn):
        self._serving.req = req
        try:
            return super().handle_request(req, conn)
        finally:
            self._serving.req = None

    # -- the app's Connection: close is kept -------------------------------------------
    def load_wsgi(self):
        super().load_wsgi()             # a bad setting stops gunicorn here (wsgi.py)
        from kvproxy.config import load_settings
        settings = load_settings()
        self.receive_timeout = settings.receive_timeout
        self.body_limit = int(settings.max_body_mb * 1024 * 1024)
        app, serving = self.wsgi, self._serving

        def closing(environ, start_response):
            def start(status, headers, exc_info=None):
                if any(name.lower() == "connection" and "close" in value.lower()
                       for name, value in headers):
                    req = getattr(serving, "req", None)
                    if req is not None:
                        req.force_close()
                return start_response(status, headers, exc_info)
            return app(environ, start)

        closing.__wrapped__ = app       # worker_exit (gunicorn_conf) saves the slots through it
        self.wsgi = closing
