"""What a request brings into the relay: who sends it and what it asks, nothing from a global.

web/ builds these from the HTTP request (its user, address and agent, its body and
headers) and hands them in; everything the relay decides (the session, the checks, the
slot) is decided from them, so the relay runs the same under Flask, in a test, or
behind another front.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from kvproxy.errors import MISSING_KEY, ClientError
from kvproxy.sessions import route_identity

# What a ChatCall's session is read from, besides its messages (``ChatCall.kind``).
RESPONSES, INFILL, MESSAGES = "responses", "infill", "messages"


@dataclass(frozen=True)
class Caller:
    """Who sends a request: the user of its API key (when keys are set), else the client's
    address (behind a trusted proxy, the forwarded one) and its User-Agent."""

    user: str | None = None
    address: str = ""
    agent: str = ""

    def scope(self, keys_set: bool) -> tuple[str | None, str | None]:
        """``(user, client)`` for ``identity.scoped``: the key's user when keys are set (never
        unscoped then), else what identifies the client."""
        if keys_set:
            if not self.user:
                raise ClientError(MISSING_KEY, 401)
            return self.user, None
        return None, f"{self.address}\x00{self.agent}"


def scope_of(caller: Caller | None, keys_set: bool) -> tuple[str | None, str | None]:
    """A caller's scope; a call without one (run outside an HTTP request) is unscoped."""
    return caller.scope(keys_set) if caller is not None else (None, None)


@dataclass
class ChatCall:
    """One generation request, already in llama-server's OpenAI-style shape, with its caller."""

    body: dict
    headers: Mapping[str, str] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict)  # the client's body, as sent
    path: str = "/v1/chat/completions"
    kind: str = MESSAGES  # RESPONSES, INFILL: its session is read from that route's fields
    side: bool = False  # force a side request (never saved), e.g. embeddings
    model: str | None = None  # the model asked for, where the body does not name it (Ollama)
    # The answer is rendered in another API's format (Anthropic, Ollama) from its timings, so
    # they count a base prefill of this request too; relayed answers keep llama-server's.
    translated: bool = False
    # False once the client has gone (checked after waiting for the slot, before a swap).
    still_wanted: Callable[[], bool] | None = None
    caller: Caller | None = None  # None: no client to scope by (a call from code, a test)

    @property
    def messages(self) -> list[dict]:
        """The conversation: a Responses request's is ``instructions`` plus ``input``."""
        if self.kind == RESPONSES:
            return route_identity.responses_messages(self.body)
        if "messages" in self.body:
            return list(self.body.get("messages") or [])
        prompt = self.body.get("prompt")
        return [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}]

    @property
    def requested_model(self) -> object:
        """The model the request names (behind a router: which switch serves it)."""
        return self.model or self.body.get("model")


@dataclass(frozen=True)
class RawCall:
    """A llama-server route's request, sent on with its bytes unchanged (passthrough)."""

    method: str
    path: str
    query: bytes = b""
    data: bytes = b""
    content_type: str | None = None
    model: object = None  # the model it names, in its JSON body or form
    changes_fingerprint: bool = False  # the adapters llama-server applies change with it


def pinned(body: Any, slot: int) -> Any:
    """A JSON object body with ``id_slot`` set to the leased slot (other bodies as they are)."""
    return {**body, "id_slot": slot} if isinstance(body, dict) else body
