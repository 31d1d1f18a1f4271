"""HTTP client for llama-server: slot actions, model facts and chat calls.

Contract: llama-server's own 4xx/5xx answers raise ``UpstreamError`` with its
message; failures to reach it raise ``UpstreamUnavailable`` (503 with Retry-After
when it cannot be connected to: stopped, or restarting). Nothing here knows
about sessions, locks or client wire formats.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterator

import requests

from kvproxy.errors import ClientGone, UpstreamError, UpstreamUnavailable, map_exceptions
from kvproxy.upstream.view import ServerView
from kvproxy.upstream.watch import CuttableAdapter, cut_when_gone

__all__ = ["LlamaClient", "UpstreamError", "UpstreamUnavailable", "sse_events", "upstream_error"]


def _error_message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or body)


# llama-server answers some requests that can never succeed with a 500 (a parse exception
# in its handler, media the model has no projector for); they are the client's fault and
# are passed on as a 400, so SDKs do not retry them (docs/clients.md lists each).
_CLIENT_FAULTS = re.compile(r"Failed to parse|json\.exception\.(?:type_error|parse_error)"
                            r"|(?:image|audio|video) input is not supported")


# Seconds a client is told to wait when llama-server is down or loading its model
# (``make run`` starts it again after a crash).
RETRY_AFTER_DOWN = 5


# llama-server started with --api-key refuses calls without its key: that is kvproxy's
# setting to fix, not the client's key, so the client gets a 502 that says which.
UPSTREAM_KEY_HINT = ("refused kvproxy's call (401 {message}): set "
                     "KVPROXY_UPSTREAM_API_KEY to the --api-key llama-server was started with")


def upstream_error(status: int, message: str) -> "UpstreamError":
    if status == 500 and _CLIENT_FAULTS.search(message):
        status = 400
    if status == 401:
        error = UpstreamError(502, UPSTREAM_KEY_HINT.format(message=message))
        error.unauthorized = True
        return error
    error = UpstreamError(status, message)
    if status == 503:  # loading the model: worth a retry
        error.retry_after = RETRY_AFTER_DOWN
    return error


# /tokenize and /apply-template are answered by llama-server's HTTP threads, not behind the
# slots' task queue: in milliseconds even while every slot generates. Their callers may hold a
# slot (the restore check, a base snapshot), which a stalled llama-server must not keep for
# the 600 s a generation may take.
PROMPT_READ_TIMEOUT = 30   # as /props and /slots


class LlamaClient:
    """One llama-server, reached over HTTP with bounded waits.

    ``model``: one model behind llama-server's router (``--models-dir``), for which every
    model and slot call names it (``for_model``); slot listings and model facts never make
    the router load it (``autoload=false``). ``view``: what the server says about itself,
    cached for every reader (``upstream.view``).
    """

    def __init__(self, base_url: str, connect_timeout: float = 5, read_timeout: float = 600,
                 slot_action_timeout: float = 300, model: str | None = None,
                 api_key: str = ""):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.slot_action_timeout = slot_action_timeout
        self.http = requests.Session()
        # llama-server is a configured local hop: looking up proxy variables on every
        # call cost about half a millisecond, and an internet proxy must not carry it.
        self.http.trust_env = False
        for prefix in ("http://", "https://"):
            self.http.mount(prefix, CuttableAdapter())
        if api_key:  # llama-server started with --api-key: every call, relayed ones too
            self.http.headers["Authorization"] = f"Bearer {api_key}"
        self._witness: tuple[Any, Any] | None = None
        self.view = ServerView(self)

    def _request(self, method: str, path: str, *, read_timeout: float | None = None,
                 stream: bool = False, slot_call: bool = False,
                 **kwargs: Any) -> requests.Response:
        timeout = (self.connect_timeout, read_timeout or self.read_timeout)
        with self.unreachable():
            # llama-server never redirects, and following redirects costs a fifth of a millisecond.
            response = self.http.request(method, self.base_url + path, timeout=timeout,
                                         stream=stream or slot_call, allow_redirects=False,
                                         **kwargs)
        if slot_call:
            self._remember_connection(response)
        if response.status_code >= 400:
            message = _error_message(response)
            response.close()
            raise upstream_error(response.status_code, message)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        with map_exceptions({
                requests.RequestException: self._stopped,  # the connection broke while reading
                ValueError: lambda exc: UpstreamError(
                    502, f"llama-server sent invalid JSON for {path}")}):
            return response.json()

    # -- the boundary: requests' exceptions as kvproxy's ---------------------
    def unreachable(self):
        """Failures to send a request, or to get its answer's head, as ``UpstreamUnavailable``:
        a connection that fails or breaks (llama-server stopped or restarting) is 503 with
        Retry-After, a read that times out 502."""
        return map_exceptions({
            requests.ConnectionError: lambda exc: UpstreamUnavailable(
                f"llama-server at {self.base_url} is not reachable: {exc.__class__.__name__}",
                503, retry_after=RETRY_AFTER_DOWN),
            requests.RequestException: lambda exc: UpstreamUnavailable(
                f"llama-server at {self.base_url} is not reachable: {exc.__class__.__name__}")})

    def _stopped(self, exc: BaseException) -> UpstreamUnavailable:
        return UpstreamUnavailable(
            f"llama-server at {self.base_url} stopped answering: {exc.__class__.__name__}")

    def content(self, response: requests.Response) -> bytes:
        """The whole body of a ``forward`` answer; a broken read is ``UpstreamUnavailable``."""
        try:
            with map_exceptions({requests.RequestException: self._stopped}):
                return response.content
        finally:
            response.close()

    def chunks(self, response: requests.Response) -> Iterator[bytes]:
        """A ``forward`` answer's body as it comes; a broken read is ``UpstreamUnavailable``."""
        try:
            with map_exceptions({requests.RequestException: self._stopped}):
                yield from response.iter_content(chunk_size=None)
        finally:
            response.close()

    # -- restart detection -------------------------------------------------
    def _remember_connection(self, response: requests.Response) -> None:
        connection = getattr(response.raw, "connection", None)
        sock = getattr(connection, "sock", None)
        self._witness = (connection, sock) if sock is not None else None

    def witness(self) -> tuple[Any, Any] | None:
        """The connection of the last slot call, to ask ``still_open`` about later: a
        llama-server restart closes every connection to the old process, so one still open
        proves the slot holds what that call left (no ``/slots`` round trip on a hit). Each
        slot keeps the witness of the moment its content was recorded."""
        return self._witness

    def still_open(self, witness: tuple[Any, Any] | None) -> bool:
        """Whether a connection that existed then is still open: llama-server has not
        restarted since. Behind the router it proves nothing: the router stays up while it
        unloads and loads the model's own llama-server."""
        if witness is None or self.model:
            return False
        connection, sock = witness
        return connection.sock is sock and bool(getattr(connection, "is_connected", False))

    # -- model facts -------------------------------------------------------
    def for_model(self, model: str) -> "LlamaClient":
        """A client of the same server for one model behind its router. The router drops
        kept-alive connections while it loads and unloads models (a reused one then fails
        with a connection error), so each call opens its own: a local hop, and its open
        connection proves nothing here anyway (``still_open``)."""
        client = LlamaClient(self.base_url, self.connect_timeout, self.read_timeout,
                             self.slot_action_timeout, model=model, api_key=self.api_key)
        client.http.headers["Connection"] = "close"
        return client

    def _named(self, body: dict) -> dict:
        return {**body, "model": self.model} if self.model else body

    def _query(self, autoload: bool = True) -> dict:
        if not self.model:
            return {}
        return {"model": self.model} if autoload else {"model": self.model, "autoload": "false"}

    def health(self) -> dict:
        return self._json("GET", "/health", read_timeout=self.connect_timeout)

    def props(self, autoload: bool = True) -> dict:
        """``/props`` (of ``model``: ``autoload=False`` answers 400 while it is not loaded)."""
        return self._json("GET", "/props", read_timeout=30, params=self._query(autoload))

    def models(self) -> dict:
        """``/v1/models``; for ``model``, only its entry."""
        listing = self._json("GET", "/v1/models", read_timeout=30)
        if self.model and isinstance(listing, dict):
            listing = {**listing, "data": [e for e in listing.get("data") or []
                                           if isinstance(e, dict) and e.get("id") == self.model]}
        return listing

    def lora_adapters(self) -> list:
        """``/lora-adapters``: every adapter loaded (``id``, ``path``, ``scale``: 0 when not
        applied)."""
        return self._json("GET", "/lora-adapters", read_timeout=30, params=self._query())

    def slots(self) -> list[dict]:
        return self._json("GET", "/slots", read_timeout=30, params=self._query(autoload=False))

    def tokenize(self, content: str, add_special: bool = False) -> list[int]:
        return self._json("POST", "/tokenize", read_timeout=PROMPT_READ_TIMEOUT,
                          json=self._named({"content": content,
                                            "add_special": add_special}))["tokens"]

    def apply_template(self, body: dict) -> str:
        return self._json("POST", "/apply-template", read_timeout=PROMPT_READ_TIMEOUT,
                          json=self._named(body))["prompt"]

    def prefill(self, tokens: list[int], slot_id: int) -> dict:
        """Compute ``tokens`` into the slot without generating (a base snapshot's system prompt)."""
        return self._json("POST", "/completion", json=self._named({
            "prompt": tokens, "n_predict": 0, "cache_prompt": True, "id_slot": slot_id,
            "stream": False}), slot_call=True)

    # -- slot actions ------------------------------------------------------
    def slot_action(self, slot_id: int, action: str, filename: str | None = None,
                    autoload: bool = True) -> dict:
        """save, restore or erase; returns llama-server's answer (with timings).
        ``autoload=False``: a router answers 400 for a model it has not loaded rather than
        load it (erasing a slot the unload emptied anyway)."""
        body = {"filename": filename} if filename else {}
        query = "" if autoload or not self.model else "&autoload=false"
        return self._json("POST", f"/slots/{slot_id}?action={action}{query}",
                          json=self._named(body), read_timeout=self.slot_action_timeout,
                          slot_call=True)

    # -- generation --------------------------------------------------------
    # Callers hold the slot: these calls count as slot calls for restart detection.
    def post_json(self, path: str, body: dict,
                  still_wanted: Callable[[], bool] | None = None) -> dict:
        """A whole answer. With ``still_wanted``, the client watcher asks it a few times a
        second while llama-server works, and once it says no closes the request's connection:
        llama-server stops the task, and this raises ``ClientGone``."""
        if still_wanted is None:
            return self._json("POST", path, json=body, slot_call=True)
        with cut_when_gone(still_wanted) as watch:
            try:
                return self._json("POST", path, json=body, slot_call=True)
            except (UpstreamUnavailable, UpstreamError) as exc:
                if watch.cut:
                    raise ClientGone("the client left before its answer was ready: "
                                     "llama-server's task was stopped") from exc
                raise

    def post_stream(self, path: str, body: dict) -> requests.Response:
        """Open a streaming POST; the caller reads it with ``sse_events`` and closes it."""
        return self._request("POST", path, json=body, stream=True, slot_call=True)

    # -- plain relaying ----------------------------------------------------
    def forward(self, method: str, path: str, *, query: bytes = b"", data: bytes = b"",
                content_type: str | None = None, read_timeout: float | None = None,
                slot_call: bool = False) -> requests.Response:
        """Send a client's request on unchanged and return llama-server's answer, whatever
        its status, streamed (the caller closes it); only an unreachable server raises."""
        url = self.base_url + path + (("?" + query.decode("latin-1")) if query else "")
        headers = {"Content-Type": content_type} if content_type else {}
        with self.unreachable():
            response = self.http.request(method, url, data=data or None, headers=headers,
                                         timeout=(self.connect_timeout,
                                                  read_timeout or self.read_timeout),
                                         stream=True, allow_redirects=False)
        if slot_call:
            self._remember_connection(response)
        return response


# The Responses API's events that end an answer.
_LAST_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def ends_the_answer(event: Any) -> bool:
    """Whether a parsed event of ``sse_events`` ends the answer: ``[DONE]`` (None), a
    choice's ``finish_reason``, ``/completion``'s ``stop`` or the Responses API's last event.
    What follows it (usage, ``[DONE]``) is no more than the end of the stream."""
    if event is None:
        return True
    if not isinstance(event, dict):
        return False
    if event.get("stop") is True or event.get("type") in _LAST_RESPONSE_EVENTS:
        return True
    choices = event.get("choices")
    return isinstance(choices, list) and any(
        isinstance(choice, dict) and choice.get("finish_reason") for choice in choices)


def sse_events(response: requests.Response) -> Iterator[tuple[bytes, Any]]:
    """Yield ``(raw_event_bytes, parsed_json)`` for each ``data:`` event as it arrives.

    ``[DONE]`` yields ``(raw, None)``; comment lines (``: ping``) are skipped.
    An ``event:`` line (the Responses API names its events) stays in the raw
    bytes in front of its data, so a relayed stream keeps it.
    An ``error`` object inside the stream raises ``UpstreamError``; a connection that
    breaks mid-stream (llama-server killed) raises ``UpstreamUnavailable``.
    """
    name = b""
    lines = response.iter_lines(chunk_size=None)
    broken = {requests.RequestException: lambda exc: UpstreamUnavailable(
        f"llama-server stopped answering mid-stream: {exc.__class__.__name__}")}
    while True:
        with map_exceptions(broken):
            line = next(lines, None)
        if line is None:
            return
        if not line or line.startswith(b":"):
            continue
        if line.startswith(b"event:"):
            name = line + b"\n"
            continue
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        raw, name = name + line + b"\n\n", b""
        if payload == b"[DONE]":
            yield raw, None
            return
        try:
            event = json.loads(payload)
        except ValueError as exc:
            raise UpstreamError(502, "llama-server sent an unreadable stream event") from exc
        if isinstance(event, dict) and "error" in event and not event.get("choices"):
            error = event["error"]
            message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            code = error.get("code", 500) if isinstance(error, dict) else 500
            raise upstream_error(code if isinstance(code, int) else 500, message)
        yield raw, event
