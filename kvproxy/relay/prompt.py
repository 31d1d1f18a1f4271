"""A request's prompt as llama-server templates and tokenizes it, worked out only when asked.

The switch asks for it after a restore that looks unused (the restore check) and for a
base snapshot (the system prompt's tokens); most requests never need it.
"""
from __future__ import annotations

import json

from kvproxy.relay.context import ChatCall
from kvproxy.upstream.llama import LlamaClient


class Prompt:
    """A request's prompt as llama-server tokenizes it, worked out only when the switch asks:
    for a restore check (after a restore that looks unused) and for a base snapshot."""

    def __init__(self, client: LlamaClient, call: ChatCall):
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
