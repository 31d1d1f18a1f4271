"""Work refused before the slot is taken: several answers, too many messages, too much text.

Each check runs on the request alone (and the slot's context size, looked up only for a
long one), so a request that cannot be served never waits for a slot or holds one.
"""
from __future__ import annotations

from typing import Any, Callable

from kvproxy.config import Settings
from kvproxy.errors import ClientError
from kvproxy.relay.context import ChatCall

# The body fields in which llama-server takes the number of answers to one prompt
# (``n_cmpl``, with OpenAI's ``n`` as its alias; server-schema.cpp).
ANSWER_COUNT_FIELDS = ("n_cmpl", "n")
# Texts up to this many characters a token's bound fit any slot: no context size asked.
SHORT_TEXT_TOKENS = 256


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
    """Refuse a request for several answers (``answers_asked``): kvproxy leases one slot
    per request."""
    asked = answers_asked(body)
    if asked:
        raise ClientError(f"'{asked[0]}' is {asked[1]}: kvproxy answers one completion per "
                          "request (llama-server would run the others in slots that hold "
                          "other conversations); send the request again for another answer")


def check_fits(call: ChatCall, settings: Settings,
               slot_context: Callable[[object], int | None]) -> None:
    """Refuse work that cannot fit: more messages than any real conversation holds
    (llama-server would render their template for minutes with the slot held), or more
    text than the slot's context (``slot_context`` of the model asked for; None when
    unknown) could take at a generous bound of characters per token (llama-server would
    refuse it after tokenizing)."""
    check_one_answer(call.body)
    messages = call.messages
    if len(messages) > settings.max_messages:
        raise ClientError(f"the request has {len(messages)} messages; kvproxy takes at most "
                          f"{settings.max_messages} (KVPROXY_MAX_MESSAGES)")
    chars = text_chars(messages)
    bound = settings.max_chars_per_token
    if chars <= bound * SHORT_TEXT_TOKENS:
        return
    n_ctx = slot_context(call.requested_model)
    if n_ctx is not None and chars > n_ctx * bound:
        raise ClientError(f"the request exceeds the available context size: {chars} "
                          f"characters of text cannot fit the slot's {n_ctx} tokens "
                          f"(more than {bound:g} characters a token, "
                          "KVPROXY_MAX_CHARS_PER_TOKEN)")
