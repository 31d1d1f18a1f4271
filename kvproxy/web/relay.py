"""Carries one neutral chat request through the slot switch to llama-server.

Dialects (Ollama, OpenAI, Anthropic) translate their wire format into a
``ChatCall`` whose body is an OpenAI-style llama-server request, and render
what comes back. The relay picks the session, holds the slot for the whole
exchange and tells the switch what the answer's timings showed.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from kvproxy.errors import ClientError, ClientGone, KvproxyError
from kvproxy.errors import ShuttingDown  # imported from here too
from kvproxy.sessions import identity, matching
from kvproxy.config import Settings
from kvproxy.upstream.llama import LlamaClient, sse_events
from kvproxy.slots.lease import Lease
from kvproxy.slots.models import ModelSwitches
from kvproxy.slots.switch import SlotSwitch
from kvproxy.slots.unpinned import side_task
from kvproxy.translate import usage
from kvproxy.web import users


log = logging.getLogger("kvproxy.relay")


_stop_at: list[float] = []  # monotonic deadline for running streams, set once at shutdown


def begin_shutdown(grace: float) -> None:
    """Called on SIGTERM (gunicorn.conf.py): streams may run ``grace`` seconds more."""
    if not _stop_at:
        _stop_at.append(time.monotonic() + grace)


def past_shutdown_grace() -> bool:
    return bool(_stop_at) and time.monotonic() >= _stop_at[0]


@dataclass
class ChatCall:
    """One generation request, already in llama-server's OpenAI-style shape."""

    body: dict
    headers: Mapping[str, str] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict)
    path: str = "/v1/chat/completions"
    side: bool = False  # force a side request (never saved), e.g. embeddings
    session: identity.Session | None = None  # a route that names its session itself (infill)
    model: str | None = None  # the model asked for, where the body does not name it (Ollama)
    # The answer is rendered in another API's format (Anthropic, Ollama) from its timings, so
    # they count a base prefill of this request too; relayed answers keep llama-server's.
    translated: bool = False
    # False once the client has gone (checked after waiting for the slot, before a swap).
    still_wanted: Callable[[], bool] | None = None

    @property
    def messages(self) -> list[dict]:
        if "messages" in self.body:
            return list(self.body.get("messages") or [])
        prompt = self.body.get("prompt")
        return [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}]


def timings_from_usage(result: Any) -> dict:
    """``cache_n``/``prompt_n``/``predicted_n`` from a usage object, for answers that carry
    no ``timings`` (llama-server's whole Responses API answer)."""
    usage = result.get("usage") if isinstance(result, dict) else None
    if not isinstance(usage, dict) or "input_tokens" not in usage:
        return {}
    details = usage.get("input_tokens_details")
    cached = int((details or {}).get("cached_tokens") or 0) if isinstance(details, dict) else 0
    return {"cache_n": cached, "prompt_n": max(int(usage.get("input_tokens") or 0) - cached, 0),
            "predicted_n": int(usage.get("output_tokens") or 0)}


class Answer:
    """A whole answer that holds the slot until it is closed.

    The server closes it once the reply is sent, so recording what the answer
    showed (sidecar, state file) does not delay the client.
    """

    def __init__(self, switch: SlotSwitch, lease: Lease, result: Any, translated: bool = False):
        self._switch = switch
        self.lease = lease
        timings = result.get("timings") if isinstance(result, dict) else None
        # llama-server's own figures, for the switch (it counts a base prefill itself)
        self.timings: dict = timings if isinstance(timings, dict) else timings_from_usage(result)
        self.result = usage.honest(result, lease.prefill, translated)
        self.headers = lease.headers(self.timings)

    def close(self) -> None:
        """Record the answer's timings and free the slot; idempotent."""
        self._switch.release(self.lease, self.timings)


class Exchange:
    """A streaming answer that holds the slot until it is closed."""

    def __init__(self, switch: SlotSwitch, lease: Lease, response, translated: bool = False):
        self._switch = switch
        self.lease = lease
        self._response = response
        self._translated = translated
        self.timings: dict = {}
        self.headers = lease.headers()

    def events(self) -> Iterator[tuple[bytes, dict | None]]:
        """Upstream SSE events as ``(raw bytes, parsed)``, as they arrive; their usage
        counts a base prefill of this request as computed (``usage.honest``)."""
        for raw, event in sse_events(self._response):
            if past_shutdown_grace():
                raise ShuttingDown("kvproxy is shutting down: the answer was cut short; "
                                   "send the request again")
            if isinstance(event, dict) and isinstance(event.get("timings"), dict):
                self.timings = event["timings"]
            told = usage.honest(event, self.lease.prefill, self._translated)
            if told is not event:
                raw, event = usage.reencoded(raw, told), told
            yield raw, event

    def close(self) -> None:
        """Close the upstream request (llama-server stops generating) and free the slot."""
        try:
            self._response.close()
        finally:
            self._switch.release(self.lease, self.timings)


class Prompt:
    """A request's prompt as llama-server tokenizes it, worked out only when the switch asks:
    for a restore check (after a restore that looks unused) and for a base snapshot."""

    def __init__(self, client: LlamaClient, call: "ChatCall"):
        self._client = client
        self._call = call
        self._templated: str | None = None
        self._tokens: list[int] | None = None

    def _chat_body(self, messages: list[dict], generation_prompt: bool) -> dict:
        body = {k: v for k, v in self._call.body.items()
                if k in ("tools", "tool_choice", "chat_template_kwargs", "reasoning_format")}
        return {**body, "messages": messages, "add_generation_prompt": generation_prompt}

    def templated(self) -> str:
        if self._templated is None:
            if "messages" in self._call.body:
                self._templated = self._client.apply_template(
                    self._chat_body(self._call.messages, True))
            else:
                prompt = self._call.body.get("prompt")
                self._templated = prompt if isinstance(prompt, str) else ""
        return self._templated

    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._tokens = self._client.tokenize(self.templated(), add_special=True)
        return self._tokens

    def system_tokens(self, min_tokens: int = 0) -> list[int] | None:
        """The leading tokens of the templated system prompt alone, shared with the full prompt.

        The system messages are templated on their own; the part of that text the
        full prompt starts with is tokenized, and only tokens the full prompt's
        tokenization also starts with are kept (token boundaries can differ at
        the cut).
        """
        messages = self._call.messages
        system = []
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
                break
            system.append(message)
        if not system or len(system) == len(messages) or "messages" not in self._call.body:
            return None
        if len(json.dumps([m.get("content") for m in system])) < min_tokens:
            return None  # too short to be worth a snapshot: spare the template and tokenizer
        alone = self._client.apply_template(self._chat_body(system, False))
        full = self.templated()
        shared = full[:next((i for i, (a, b) in enumerate(zip(alone, full)) if a != b),
                            min(len(alone), len(full)))]
        if not shared:
            return None
        head = self._client.tokenize(shared, add_special=True)
        whole = self.tokens()
        n = 0
        for a, b in zip(head, whole):
            if a != b:
                break
            n += 1
        return whole[:n] or None


def text_chars(messages: list) -> int:
    """Characters of the text a request's messages carry (string contents and text parts;
    images, audio and tool definitions are not counted, so the count never says more than
    the prompt holds)."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    total += len(text)
    return total


# The body fields in which llama-server takes the number of answers to one prompt
# (``n_cmpl``, with OpenAI's ``n`` as its alias; server-schema.cpp).
ANSWER_COUNT_FIELDS = ("n_cmpl", "n")


def answers_asked(body: Any) -> tuple[str, int] | None:
    """The field that asks for several answers to one prompt and its value, or None: the
    first of ``ANSWER_COUNT_FIELDS`` present decides, as in llama-server. llama-server runs
    every answer after the first in another idle slot, copying the leased slot's state over
    whatever conversation that slot held."""
    if not isinstance(body, dict):
        return None
    for name in ANSWER_COUNT_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        several = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1
        return (name, value) if several else None  # other values: llama-server judges them
    return None


def check_one_answer(body: Any) -> None:
    """Refuse, before the slot is taken, a request for several answers (``answers_asked``):
    kvproxy leases one slot per request."""
    asked = answers_asked(body)
    if asked:
        raise ClientError(f"'{asked[0]}' is {asked[1]}: kvproxy answers one completion per "
                          "request (llama-server would run the others in slots that hold "
                          "other conversations); send the request again for another answer")


def pinned(body: Any, slot: int) -> Any:
    """A JSON object body with ``id_slot`` set to the leased slot (other bodies as they are)."""
    return {**body, "id_slot": slot} if isinstance(body, dict) else body


class Relay:
    """The path from a dialect to llama-server."""

    def __init__(self, settings: Settings, client: LlamaClient, switch: SlotSwitch,
                 models: ModelSwitches | None = None):
        self.settings = settings
        self.client = client
        self.switch = switch
        self.models = models or ModelSwitches(client, switch, None)
        self._trails: dict[str, matching.TrailIndex] = {}  # per slot folder

    def session_for(self, call: ChatCall, stream: bool,
                    switch: SlotSwitch | None = None) -> identity.Session:
        """The request's session, as its user (API keys) or its client sees it
        (``identity.scoped``, ``kvproxy.web.users``); a conversation without an id is
        followed by what it shares with this user's or client's saved ones (``matching``)."""
        user, client = users.request_scope()
        named = self._named_session(call, stream)
        session = identity.scoped(named, user=user, client=client)
        if named.source != "conversation-hash":
            return session
        min_chars = self.settings.match_min_tokens * matching.CHARS_PER_TOKEN
        if min_chars <= 0:
            return session
        store = (switch or self.switch).store
        index = self._trails.get(str(store.root))
        if index is None:
            index = self._trails.setdefault(str(store.root), matching.TrailIndex(store.root))
        store.tell_sidecar_writes(index.learn)
        scope = matching.scope_of(user, client)
        trail = matching.trail_of(call.messages, call.body.get("tools"))

        def rescope(session_id: str) -> identity.Session:
            return identity.scoped(dataclasses.replace(named, id=session_id, key=session_id),
                                   user=user, client=client)
        followed = matching.follow(session, trail, index.records(scope), scope, min_chars,
                                   rescope)
        index.note(followed.trail)
        return followed

    def _named_session(self, call: ChatCall, stream: bool) -> identity.Session:
        if call.side:
            return identity.Session(identity.SIDE_SESSION, "side-request", persistent=False)
        if call.session is not None:
            return call.session
        return identity.resolve(
            call.headers, call.raw, call.messages, stream=stream,
            header_names=self.settings.session_headers,
            anonymous=self.settings.anonymous_sessions,
            side_pattern=self.settings.side_request_pattern)

    @staticmethod
    def _upstream_body(call: ChatCall, stream: bool, lease: Lease, client: LlamaClient) -> dict:
        """The body as sent: pinned to the leased slot, so llama-server never picks another;
        behind a router, naming the model by the router's id."""
        body = {**call.body, "stream": stream, "cache_prompt": True, "id_slot": lease.slot}
        return {**body, "model": client.model} if client.model else body

    def _slot_context(self, model: object = None) -> int | None:
        """Tokens of context one slot has (``/props``, cached briefly); None when unknown."""
        try:
            props = self.model_facts(model)["props"]
        except (KvproxyError, KeyError, TypeError):
            return None  # llama-server down: the swap answers for it
        settings = props.get("default_generation_settings") if isinstance(props, dict) else None
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        return n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None

    def check_fits(self, call: ChatCall) -> None:
        """Refuse, before the slot is taken, work that cannot fit: more messages than any real
        conversation holds (llama-server would render their template for minutes with the slot
        held), or more text than the slot's context could take at a generous bound of
        characters per token (llama-server would refuse it after tokenizing)."""
        check_one_answer(call.body)
        messages = call.messages
        if len(messages) > self.settings.max_messages:
            raise ClientError(f"the request has {len(messages)} messages; kvproxy takes at most "
                              f"{self.settings.max_messages} (KVPROXY_MAX_MESSAGES)")
        chars = text_chars(messages)
        bound = self.settings.max_chars_per_token
        if chars <= bound * 256:  # too short to need the context size
            return
        n_ctx = self._slot_context(call.model or call.body.get("model"))
        if n_ctx is not None and chars > n_ctx * bound:
            raise ClientError(f"the request exceeds the available context size: {chars} "
                              f"characters of text cannot fit the slot's {n_ctx} tokens "
                              f"(more than {bound:g} characters a token, "
                              "KVPROXY_MAX_CHARS_PER_TOKEN)")

    def _acquire(self, call: ChatCall, stream: bool) -> tuple[SlotSwitch, LlamaClient, Lease]:
        self.check_fits(call)
        switch, client = self.models.route(call.model or call.body.get("model"))
        lease = switch.acquire(self.session_for(call, stream=stream, switch=switch),
                               still_wanted=call.still_wanted, prompt=Prompt(client, call))
        return switch, client, lease

    def stream(self, call: ChatCall) -> Exchange:
        """Take the slot and open a streaming request; the caller must close the exchange.

        Everything between taking the slot and handing back the exchange
        (opening the request, building the reply headers) frees the slot if it fails.
        """
        switch, client, lease = self._acquire(call, True)
        response = None
        try:
            response = client.post_stream(call.path, self._upstream_body(call, True, lease, client))
            return Exchange(switch, lease, response, call.translated)
        except BaseException:
            try:
                if response is not None:
                    response.close()
            finally:
                switch.release(lease)
            raise

    def complete(self, call: ChatCall) -> Answer:
        """Take the slot for one non-streaming request; the caller must close the answer.
        A client that leaves while llama-server works closes the upstream request
        (``ClientGone``), which stops the task and frees the slot."""
        switch, client, lease = self._acquire(call, False)
        try:
            result = client.post_json(call.path, self._upstream_body(call, False, lease, client),
                                      still_wanted=call.still_wanted)
            return Answer(switch, lease, result, call.translated)
        except ClientGone:
            log.info("client of session %s left before its answer was ready: "
                     "upstream request closed", lease.session.id)
            switch.release(lease)
            raise
        except BaseException:
            switch.release(lease)
            raise

    def side_call(self, path: str, body: dict) -> dict:
        """A request that uses a slot but belongs to no conversation (embeddings).
        llama-server ignores its ``id_slot``: it runs while every slot is held (``unpinned``)."""
        switch, client = self.models.route(body.get("model"))
        with side_task(switch) as lease:
            return client.post_json(path, pinned(client._named(body), lease.slot))

    def model_facts(self, requested: object = None) -> dict:
        """llama-server's /props and /v1/models, cached briefly, plus the served name; behind
        a router, of the model ``requested`` names (else its first). See ``ServerView``."""
        return self.models.view.model_facts(requested, self.settings.model_name)

    def all_model_facts(self) -> list[dict]:
        """``model_facts`` of every model llama-server serves (one, unless it is a router)."""
        if not self.models.is_router():
            return [self.model_facts()]
        return self.models.view.all_model_facts(self.settings.model_name)

    def count_tokens(self, body: dict) -> int:
        """Tokens of the templated prompt, counted by llama-server's own tokenizer."""
        _, client = self.models.route(body.get("model"))
        prompt = client.apply_template(body)
        return len(client.tokenize(prompt))
