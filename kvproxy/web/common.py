"""What every dialect does the same way: read the body, name the caller, run the call, hold
the slot until the reply is sent."""
from __future__ import annotations

import logging
import queue
import select
import socket
import threading
from typing import Any, Callable, Iterable, Iterator

from flask import Response, current_app, request

from kvproxy.errors import ClientError, InternalError, KvproxyError
from kvproxy.relay.context import Caller, ChatCall
from kvproxy.relay.relay import Relay
from kvproxy.translate import strict_json
from kvproxy.upstream.llama import ends_the_answer
from kvproxy.web import users

log = logging.getLogger("kvproxy.dialects")


def relay() -> Relay:
    return current_app.extensions["kvproxy.relay"]


def caller() -> Caller:
    """Who sends this request: the user its API key names (the gate put it on the request),
    the client's address (behind a trusted proxy, the forwarded one) and its User-Agent.
    The relay scopes sessions by it."""
    return Caller(user=users.request_user(),
                  address=users.client_address(
                      request.environ, current_app.config["KVPROXY"].forwarded_allow_ips),
                  agent=request.headers.get("User-Agent", ""))


def json_body() -> dict:
    """The request's JSON object, or ClientError with a message a person can act on."""
    data = strict_json.parse(request.get_data(cache=True))
    if not isinstance(data, dict):
        raise ClientError("request body must be a JSON object")
    return data


CLOSERS = "kvproxy.slot_closers"
AFTER_REPLY_THREADS = 8  # at most this many threads run the closers of replies already sent


def hold_slot_until_closed(close: Callable[[], None]) -> None:
    """Free the slot when the server closes this request's response, whatever it is.

    ``FreeHeldSlots`` runs the closers when the server closes the response it
    finally sent: the stream or answer itself, or an error page that replaced
    it (a failing hook, a failing error handler), or when the app raised.
    """
    request.environ.setdefault(CLOSERS, []).append(close)


def free_held_slot() -> None:
    """Free the slot this request holds now (its response was replaced by an error page)."""
    run_closers(request.environ)


def run_closers(environ: dict) -> None:
    """Run each closer once; one that fails does not stop the others."""
    closers = environ.get(CLOSERS) or []
    while closers:
        close = closers.pop(0)
        try:
            close()
        except Exception:  # noqa: BLE001 - the other closers must still run
            log.exception("freeing the slot failed")


class _AfterReply:
    """Threads that run the closers of replies already sent.

    gunicorn reads the next request on a kept-alive connection only once the
    response's ``close`` has returned, and a chat's closer records what the answer
    showed (state table, sidecar) before it frees the slot: about a millisecond
    that a client sending its next request at once would wait for. Each closer
    runs here with its slot still held; a thread is added (up to ``AFTER_REPLY_THREADS``)
    when none is free, so a release that has to ask llama-server (an answer cut
    short) holds up no other slot's. ``settle`` lets a reader of that record (the
    admin API, the status page) wait for the replies sent before it.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._threads = 0
        self._idle = 0     # threads waiting for work that no queued closer has claimed yet
        self._tickets = 0  # closers handed over so far
        self._pending: set[int] = set()  # their tickets, until they have run

    def reserve(self) -> int:
        """A ticket for closers still to be handed over: ``settle`` waits for it from now.
        Taken before a reply's last byte is written, so a client that has the whole
        reply cannot read records that miss it."""
        with self._lock:
            self._tickets += 1
            self._pending.add(self._tickets)
            return self._tickets

    def run(self, environ: dict, ticket: int | None = None) -> None:
        """Run the closers of ``environ`` on a thread, under ``ticket`` (reserved) or a new one."""
        if ticket is None:
            ticket = self.reserve()
        with self._lock:
            if self._idle:
                self._idle -= 1
            elif self._threads < AFTER_REPLY_THREADS:
                self._threads += 1
                threading.Thread(target=self._serve, daemon=True,
                                 name="kvproxy-after-reply").start()
        self._queue.put((ticket, environ))

    def _serve(self) -> None:
        while True:
            ticket, environ = self._queue.get()
            try:
                run_closers(environ)  # logs a failing closer and goes on
            finally:
                with self._lock:
                    self._idle += 1
                    self._pending.discard(ticket)
                    self._settled.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait until the closers handed over before this call have run (False: timed out)."""
        with self._lock:
            before = self._tickets
            return self._settled.wait_for(
                lambda: not any(ticket <= before for ticket in self._pending), timeout)


_after_reply = _AfterReply()

SETTLE_TIMEOUT = 10.0  # a release that asks llama-server is itself bounded; a read then goes on


def see_sent_replies() -> None:
    """Before a request that reads records (the route table's ``reads_records``: the admin
    API, status, metrics): the replies already sent are recorded first.

    A client that lists its sessions, reads the status page or deletes a session
    right after its answer arrived must see (or delete) that answer's record, not
    the one before it, and a delete must not be undone by a release still to run.
    """
    if not _after_reply.settle(SETTLE_TIMEOUT):
        log.warning("%s %s answered before every sent reply was recorded (waited %.0f s)",
                    request.method, request.path, SETTLE_TIMEOUT)


class FreeHeldSlots:
    """WSGI middleware: the one place that guarantees a request's slot is freed.

    Whatever happens between taking the slot and the end of the reply, the
    server closes what the app returned (or the app raised): either way the
    request's closers run, and each is idempotent. Under gunicorn (its socket in
    the environ) the closers of a reply that was sent run on ``_AfterReply``'s
    threads, so the connection takes its next request meanwhile.
    """

    def __init__(self, app: Callable) -> None:
        self.app = app

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        sized = False   # the reply has a Content-Length: it is whole in memory

        def starting(status: str, headers: list, *exc_info: Any) -> Callable:
            nonlocal sized
            sized = any(name.lower() == "content-length" for name, _ in headers)
            return start_response(status, headers, *exc_info)

        try:
            body = self.app(environ, starting)
        except BaseException:
            run_closers(environ)
            raise
        return _ClosingBody(body, environ, sized=sized)


class _ClosingBody:
    """The app's response iterable, with the request's closers run after its own close.

    The server calls ``close`` only after it wrote the last byte, and a client
    that has the whole reply may at once ask the admin API about it. So the
    ticket ``settle`` waits for is reserved before that byte (``reserve_release``):
    when the reply starts, for a reply of known length (already whole in memory);
    for a stream, when llama-server's last event arrives (``serve_chat``), or at
    the latest when the body ends (its chunked ending is written after that).
    """

    def __init__(self, body: Iterable[bytes], environ: dict, sized: bool = False) -> None:
        self._body = body
        self._iter = iter(body)
        self._environ = environ
        if sized:
            reserve_release(environ)

    def __iter__(self) -> "_ClosingBody":
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._iter)
        except StopIteration:
            reserve_release(self._environ)
            raise

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            ticket = self._environ.pop(RELEASE_TICKET, None)
            if ticket is not None or _releases_after_reply(self._environ):
                _after_reply.run(self._environ, ticket)
            else:
                run_closers(self._environ)


RELEASE_TICKET = "kvproxy.release_ticket"


def _releases_after_reply(environ: dict) -> bool:
    return bool(environ.get(CLOSERS)) and "gunicorn.socket" in environ


def reserve_release(environ: dict) -> None:
    """From now on, admin reads wait for this request's release (once; under gunicorn only,
    where releases run after the reply)."""
    if RELEASE_TICKET not in environ and _releases_after_reply(environ):
        environ[RELEASE_TICKET] = _after_reply.reserve()


def _reserved_at_the_end(events: Iterator[tuple[bytes, Any]],
                         environ: dict) -> Iterator[tuple[bytes, Any]]:
    """llama-server's events, the release reserved before the one that ends the answer goes
    on: a client may stop at what is rendered from it (openai's Python client stops reading
    at ``[DONE]``) and ask the admin API at once."""
    for raw, event in events:
        if ends_the_answer(event):
            reserve_release(environ)
        yield raw, event


def client_still_there() -> Callable[[], bool]:
    """A check whether the client is still connected (gunicorn gives the socket).

    A closed connection is readable and reads as end of file; one still open
    is not readable, or has the start of a next request waiting. Without the
    socket (other servers, tests) the client counts as there.
    """
    sock = request.environ.get("gunicorn.socket")
    if sock is None:
        return lambda: True

    def check() -> bool:
        try:
            poller = select.poll()  # poll, not select: any descriptor number
            poller.register(sock, select.POLLIN)
            if not poller.poll(0):
                return True
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:  # reset, or already closed
            return False
    return check


def serve_chat(call: ChatCall, *, stream: bool,
               render_full: Callable[[dict], Any],
               render_stream: Callable[[Iterable[tuple[bytes, dict | None]]], Iterator[bytes]],
               render_stream_error: Callable[[int, str], bytes],
               mimetype: str) -> Response:
    """Run ``call`` and answer in the dialect's format, streamed or whole.

    Either kind holds the slot until the server closes the response: a whole
    answer once it is sent (its bookkeeping then runs off the client's wait),
    a stream after its last byte or when the client goes away, which also
    closes the upstream request. Errors before the answer starts are raised (the
    app's error handler answers them); a stream that started cannot change its
    status, so it ends with an error event in the dialect's format instead.
    """
    if call.still_wanted is None:
        call.still_wanted = client_still_there()
    if call.caller is None:
        call.caller = caller()
    if not stream:
        answer = relay().complete(call)
        hold_slot_until_closed(answer.close)
        try:
            reply = render_full(answer.result)
            response = reply if isinstance(reply, Response) else current_app.json.response(reply)
            response.headers.update(answer.headers)
        except BaseException:
            answer.close()
            raise
        return response
    exchange = relay().stream(call)
    hold_slot_until_closed(exchange.close)
    bug = InternalError(request.method, request.path)  # the stream runs after the request
    environ = request.environ

    def body() -> Iterator[bytes]:
        try:
            yield from render_stream(_reserved_at_the_end(exchange.events(), environ))
        except KvproxyError as exc:
            yield render_stream_error(exc.status, exc.client_message)
        except Exception:  # a rendering bug must end the stream visibly, not silently
            log.exception("stream of session %s failed", exchange.lease.session.id)
            yield render_stream_error(bug.status, bug.message)
        finally:
            exchange.close()

    try:
        response = Response(body(), mimetype=mimetype, headers=exchange.headers)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"  # nginx: relay chunks as they come
    except BaseException:
        exchange.close()
        raise
    response.call_on_close(exchange.close)
    return response
