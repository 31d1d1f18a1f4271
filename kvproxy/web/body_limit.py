"""A bound on request bodies, checked before a body is read (``KVPROXY_MAX_BODY_MB``).

A body that announces its length is refused from the header alone; a chunked body
(no ``Content-Length``, which gunicorn passes through as ``wsgi.input_terminated``)
is read through ``BoundedInput`` and refused the moment it passes the bound.
Werkzeug's own ``MAX_CONTENT_LENGTH`` is not used: it silently truncates a
chunked body at the bound, which reads as invalid JSON instead of a 413.
The 413 is rendered in the client's API format by ``kvproxy.web.errors``.
"""
from __future__ import annotations

import io

from werkzeug.exceptions import RequestEntityTooLarge


def too_large(limit: int, length: int | None = None) -> RequestEntityTooLarge:
    size = f"is {length} bytes, more than" if length is not None else "is larger than"
    return RequestEntityTooLarge(
        f"the request body {size} the {limit / (1024 * 1024):g} MiB kvproxy accepts "
        "(KVPROXY_MAX_BODY_MB)")


class BoundedInput(io.RawIOBase):
    """A WSGI input stream that raises 413 once more than ``limit`` bytes came through."""

    def __init__(self, stream, limit: int):
        self._stream, self._limit, self._read = stream, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._stream.read(min(len(buffer), self._limit + 1 - self._read))
        self._read += len(data)
        if self._read > self._limit:
            raise too_large(self._limit)
        buffer[:len(data)] = data
        return len(data)


def limit_bytes(max_body_mb: float) -> int:
    return int(max_body_mb * 1024 * 1024)


def refuse_large_bodies(request, limit: int) -> None:
    """Before the request is read (from ``kvproxy.web.gate``): 413 for a body announced
    larger than ``limit`` bytes, a bounded stream for a chunked one."""
    length = request.content_length
    if length is not None:
        if length > limit:
            raise too_large(limit, length)
    elif request.environ.get("wsgi.input_terminated"):
        request.environ["wsgi.input"] = BoundedInput(request.environ["wsgi.input"], limit)
