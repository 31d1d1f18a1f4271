"""What every dialect does the same way: read the body, run the call, map failures."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator

from flask import Response, current_app, g, request

from ..llama import UpstreamError, UpstreamUnavailable
from ..relay import ChatCall, Relay, ShuttingDown
from ..switch import SlotBusy
from . import strict_json

log = logging.getLogger("kvproxy.dialects")

Failure = tuple[int, str, dict]


class BadRequest(ValueError):
    """The client's request cannot be served as sent."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.message = message


def relay() -> Relay:
    return current_app.extensions["kvproxy.relay"]


def json_body() -> dict:
    """The request's JSON object, or BadRequest with a message a person can act on."""
    try:
        data = strict_json.parse(request.get_data(cache=True))
    except strict_json.Refused as exc:
        raise BadRequest(str(exc)) from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def failure(exc: Exception) -> Failure:
    """Status, message and extra headers for an exception on the way to llama-server."""
    if isinstance(exc, BadRequest):
        return exc.status, exc.message, {}
    if isinstance(exc, SlotBusy):
        return 503, str(exc), {"Retry-After": str(exc.retry_after)}
    if isinstance(exc, UpstreamUnavailable):
        return 502, f"{exc}; check that llama-server is running and KVPROXY_UPSTREAM points at it", {}
    if isinstance(exc, UpstreamError):
        return exc.status, f"llama-server: {exc.message}", {}
    if isinstance(exc, ShuttingDown):
        return 503, str(exc), {"Retry-After": "5"}
    raise exc


HANDLED = (BadRequest, SlotBusy, UpstreamUnavailable, UpstreamError, ShuttingDown)


def hold_slot_until_closed(response: Response, close: Callable[[], None]) -> None:
    """Free the slot when the server closes ``response``.

    If a later hook fails, Flask sends an error page instead and this response
    is never closed: the error handler then calls ``free_held_slot``.
    """
    g.setdefault("kvproxy_slot_closers", []).append(close)
    response.call_on_close(close)


def free_held_slot() -> None:
    """Free a slot this request still holds (its response was replaced by an error)."""
    for close in g.pop("kvproxy_slot_closers", []):
        close()


def serve_chat(call: ChatCall, *, stream: bool,
               render_full: Callable[[dict], Any],
               render_stream: Callable[[Iterable[tuple[bytes, dict | None]]], Iterator[bytes]],
               render_error: Callable[[int, str, dict], Response],
               render_stream_error: Callable[[int, str], bytes],
               mimetype: str) -> Response:
    """Run ``call`` and answer in the dialect's format, streamed or whole.

    Either kind holds the slot until the server closes the response: a whole
    answer once it is sent (its bookkeeping then runs off the client's wait),
    a stream after its last byte or when the client goes away, which also
    closes the upstream request.
    """
    try:
        if not stream:
            answer = relay().complete(call)
            try:
                reply = render_full(answer.result)
                response = reply if isinstance(reply, Response) else current_app.json.response(reply)
                response.headers.update(answer.headers)
            except BaseException:
                answer.close()
                raise
            hold_slot_until_closed(response, answer.close)
            return response
        exchange = relay().stream(call)
    except HANDLED as exc:
        return render_error(*failure(exc))

    def body() -> Iterator[bytes]:
        try:
            yield from render_stream(exchange.events())
        except (UpstreamError, UpstreamUnavailable, ShuttingDown) as exc:
            status, message, _ = failure(exc)
            yield render_stream_error(status, message)
        except Exception:  # a rendering bug must end the stream visibly, not silently
            log.exception("stream of session %s failed", exchange.lease.session.id)
            yield render_stream_error(500, "internal error in kvproxy while streaming; see its log")
        finally:
            exchange.close()

    response = Response(body(), mimetype=mimetype, headers=exchange.headers)
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # nginx: relay chunks as they come
    hold_slot_until_closed(response, exchange.close)
    return response
