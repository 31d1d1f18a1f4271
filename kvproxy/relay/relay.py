"""The path from a dialect to llama-server: one call in, the slot held, the answer out.

Dialects (Ollama, OpenAI, Anthropic, llama-server's own routes) translate their wire
format into a ``ChatCall`` (``context``) whose body is an OpenAI-style llama-server
request, with its caller; the relay refuses what cannot fit (``limits``), resolves the
session (``session``), leases a slot of the model's switch, pins the body to it and hands
back an ``Answer`` or an ``Exchange`` (``answer``) that holds the slot until the server
has sent the reply. Side requests (``side``) and the model facts (the server's view) go
through here too, so web/ needs nothing of slots/ or storage/.
"""
from __future__ import annotations

import logging

import requests

from kvproxy.config import Settings
from kvproxy.errors import ClientGone, KvproxyError
from kvproxy.relay import limits, side
from kvproxy.relay.answer import Answer, Exchange
from kvproxy.relay.context import ChatCall, RawCall
from kvproxy.relay.prompt import Prompt
from kvproxy.relay.session import SessionResolver
from kvproxy.sessions.identity import Session
from kvproxy.slots.lease import Lease
from kvproxy.slots.models import ModelSwitches
from kvproxy.slots.switch import SlotSwitch
from kvproxy.upstream.llama import LlamaClient

log = logging.getLogger("kvproxy.relay")

class Relay:
    """The path from a dialect to llama-server."""

    def __init__(self, settings: Settings, client: LlamaClient, switch: SlotSwitch,
                 models: ModelSwitches | None = None):
        self.settings = settings
        self.client = client
        self.switch = switch
        self.models = models or ModelSwitches(client, switch, None)
        self.sessions = SessionResolver(settings)

    # -- a conversation's request ------------------------------------------------------
    def session_for(self, call: ChatCall, stream: bool,
                    switch: SlotSwitch | None = None) -> Session:
        """The request's session (``SessionResolver``), followed in ``switch``'s folder."""
        return self.sessions.resolve(call, stream, (switch or self.switch).store)

    def check_fits(self, call: ChatCall) -> None:
        """Refuse, before the slot is taken, work that cannot fit (``limits.check_fits``)."""
        limits.check_fits(call, self.settings, self._slot_context)

    def _slot_context(self, model: object = None) -> int | None:
        """Tokens of context one slot has (``/props``, cached briefly); None when unknown."""
        try:
            props = self.model_facts(model)["props"]
        except (KvproxyError, KeyError, TypeError):
            return None  # llama-server down: the swap answers for it
        settings = props.get("default_generation_settings") if isinstance(props, dict) else None
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        return n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None

    def _acquire(self, call: ChatCall, stream: bool) -> tuple[SlotSwitch, LlamaClient, Lease]:
        self.check_fits(call)
        switch, client = self.models.route(call.requested_model)
        lease = switch.acquire(self.session_for(call, stream=stream, switch=switch),
                               still_wanted=call.still_wanted, prompt=Prompt(client, call))
        return switch, client, lease

    @staticmethod
    def _upstream_body(call: ChatCall, stream: bool, lease: Lease, client: LlamaClient) -> dict:
        """The body as sent: pinned to the leased slot, so llama-server never picks another;
        behind a router, naming the model by the router's id."""
        body = {**call.body, "stream": stream, "cache_prompt": True, "id_slot": lease.slot}
        return {**body, "model": client.model} if client.model else body

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

    # -- requests of no conversation ---------------------------------------------------
    def side_call(self, path: str, body: dict) -> dict:
        """A request kvproxy builds that uses a slot but belongs to no conversation
        (embeddings): ``side.side_json``."""
        return side.side_json(self.models, path, body)

    def side_relayed(self, call: RawCall) -> side.SideReply:
        """A llama-server side route relayed as it came (rerank, embeddings):
        ``side.side_relayed``."""
        return side.side_relayed(self.models, call)

    def forward(self, call: RawCall, read_timeout: float) -> requests.Response:
        """A llama-server route that never touches the slot, sent on unchanged without
        waiting for it; llama-server's answer, streamed (the caller closes it). Setting the
        adapters makes every switch ask the fingerprint again."""
        upstream = self.client.forward(call.method, call.path, query=call.query,
                                       data=call.data, content_type=call.content_type,
                                       read_timeout=read_timeout)
        if call.changes_fingerprint:   # the adapters applied changed
            for switch in self.models.switches():
                switch.fingerprints.forget()
        return upstream

    def count_tokens(self, body: dict) -> int:
        """Tokens of the templated prompt, counted by llama-server's own tokenizer."""
        _, client = self.models.route(body.get("model"))
        prompt = client.apply_template(body)
        return len(client.tokenize(prompt))

    # -- what llama-server serves ------------------------------------------------------
    def model_facts(self, requested: object = None) -> dict:
        """The served model's facts (behind a router, ``requested``'s), from the server's one
        view (``ServerView.model_facts``, cached briefly), under the configured name."""
        return self.models.view.model_facts(requested, self.settings.model_name)

    def all_model_facts(self) -> list[dict]:
        """The facts of every model llama-server serves (``ServerView.all_model_facts``)."""
        return self.models.view.all_model_facts(self.settings.model_name)
