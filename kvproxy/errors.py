"""Every error kvproxy raises on purpose, and the one place foreign exceptions become them.

A ``KvproxyError`` knows how it answers a client: its HTTP status, the message
the client reads, ``Retry-After`` and any other headers. The web layer renders
it in the shape of the client's API (``kvproxy.web.errors``); nothing below the
web layer knows about wire formats. ``requests``, ``filelock`` and ``OSError``
exceptions are turned into these at the boundary where they happen, with
``map_exceptions`` (as httpx's ``map_exceptions`` does for httpcore).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

INTERNAL = "internal error in kvproxy; see its log"


class KvproxyError(Exception):
    """An error with the answer it gives: ``status``, ``message``, ``Retry-After``, headers.

    ``str(exc)`` is the bare message (for logs and for other messages to quote);
    ``client_message`` is what a client reads.
    """

    status = 500
    retry_after: int | None = None

    def __init__(self, message: str, status: int | None = None, *,
                 retry_after: int | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if retry_after is not None:
            self.retry_after = retry_after
        self.extra_headers = dict(headers or {})

    @property
    def client_message(self) -> str:
        return self.message

    @property
    def headers(self) -> dict[str, str]:
        retry = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        return {**retry, **self.extra_headers}


# The one message for a client route called without a valid key (the gate, and the relay's
# scope when a call reaches it without a user while keys are set).
MISSING_KEY = ("missing or wrong API key: send 'Authorization: Bearer <key>' or "
               "'x-api-key: <key>'")


class ClientError(KvproxyError):
    """The client's request cannot be served as sent: a 400 unless another 4xx says more
    (404 for an unknown model, 403 for a route kvproxy keeps to itself)."""

    status = 400


class InternalError(KvproxyError):
    """A bug: the one 500 a client sees, page or stream alike; the details are in the log."""

    def __init__(self, method: str, path: str):
        super().__init__(f"{method} {path}: {INTERNAL}", 500)


# -- llama-server (kvproxy.upstream.llama) -------------------------------------
class UpstreamUnavailable(KvproxyError):
    """llama-server could not be reached or did not answer in time."""

    status = 502

    @property
    def client_message(self) -> str:
        return f"{self}; check that llama-server is running and KVPROXY_UPSTREAM points at it"


class UpstreamError(KvproxyError):
    """llama-server answered with an error status; the client gets that status."""

    def __init__(self, status: int, message: str):
        super().__init__(message, status)

    @property
    def client_message(self) -> str:
        return f"llama-server: {self.message}"


# -- the slot folder (kvproxy.storage) -----------------------------------------
class StorageError(KvproxyError):
    """The slot folder cannot take a save: disk full, folder unwritable, a short write.

    Clients get 503 with Retry-After; nothing already on disk was changed.
    """

    status = 503
    retry_after = 30

    @property
    def client_message(self) -> str:
        return f"kvproxy cannot use its slot folder: {self}"


class StateFormatError(StorageError):
    """The state file was written by a newer kvproxy: refused, never guessed at (guessing
    could save an unproven slot over a session's file). Start-up stops with this line."""

    @property
    def client_message(self) -> str:
        return f"kvproxy cannot read its state file: {self}"


# -- the shared session store (kvproxy.storage.shared) ---------------------------
class StoreError(KvproxyError):
    """The shared session store (KVPROXY_STORE_URL) did not do what was asked. It never fails
    a client's request (uploads run behind; a failed fetch becomes a prefill), and its message
    names no credential: it is built from the error's code, never from the store's text."""

    status = 503
    retry_after = 30


class StoreUnavailable(StoreError):
    """The store could not be reached, did not answer in time or answered 5xx: worth trying
    again later."""


# -- the slots (kvproxy.slots.lock, kvproxy.slots.state) -----------------------
class InvalidTransition(KvproxyError):
    """A slot was asked to move between phases that cannot follow each other: a bug."""
class SlotUnavailable(KvproxyError):
    """The slot cannot be used right now; the client may retry after ``retry_after`` seconds."""

    status = 503

    def __init__(self, message: str, retry_after: int = 5):
        super().__init__(message, retry_after=retry_after)


class SlotBusy(SlotUnavailable):
    """The slot stayed taken for longer than the bound, or too many requests wait for it."""

    def __init__(self, waited: float, retry_after: int, queue_full: bool = False):
        message = ("too many requests are waiting for the model; try again shortly" if queue_full
                   else f"the model is busy with another conversation; waited {waited:.0f} s")
        super().__init__(message, retry_after)


class ClientGone(SlotUnavailable):
    """The client closed its connection while it waited for the slot (nothing to swap for),
    or while llama-server worked on its whole answer (the upstream request was closed)."""

    status = 499  # nginx's "client closed request"; nobody reads it

    def __init__(self, message: str = "the client left while waiting for the slot") -> None:
        super().__init__(message, retry_after=1)


class ShuttingDown(KvproxyError):
    """kvproxy is stopping: a stream still running past the grace period ends early,
    so its slot is freed in time for the session to be saved on the way out."""

    status = 503
    retry_after = 5


# -- the client's socket (kvproxy.web.worker) ----------------------------------
class ReceiveTimeout(TimeoutError):
    """The request's body did not arrive within ``KVPROXY_RECEIVE_TIMEOUT`` (raised by the
    gunicorn worker while the app reads it; a ``TimeoutError``, as gunicorn's own drain of
    an unread body expects). The web layer answers it as ``RequestTimedOut``."""


class RequestTimedOut(ClientError):
    """The 408 a ``ReceiveTimeout`` becomes; the connection closes after it."""

    status = 408

    def __init__(self):
        super().__init__("the request body did not arrive in time (KVPROXY_RECEIVE_TIMEOUT)",
                         headers={"Connection": "close"})


# -- start-up (kvproxy.config, kvproxy.ops.startup) -----------------------------
class ConfigError(KvproxyError, ValueError):
    """A setting has a value kvproxy cannot use (start-up stops with this one line)."""


class ContractError(ConfigError):
    """kvproxy and llama-server disagree; the message is one line with the fix."""


# -- the boundary --------------------------------------------------------------
@contextmanager
def map_exceptions(mapping: Mapping[type[BaseException], Callable[[BaseException], KvproxyError]]
                   ) -> Iterator[None]:
    """Raise ``mapping[kind](exc)`` for a foreign exception of a listed kind (first match in
    order, so list subclasses first); kvproxy's own errors and unlisted ones pass unchanged."""
    try:
        yield
    except KvproxyError:
        raise
    except Exception as exc:
        for kind, make in mapping.items():
            if isinstance(exc, kind):
                raise make(exc) from exc
        raise
