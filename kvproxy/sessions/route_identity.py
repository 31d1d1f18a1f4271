"""What names the session of requests that are not chat messages.

Pure functions, no I/O. The Responses API and fill-in-the-middle carry their
conversation in other fields than ``messages``; these adapters turn them into
what ``identity.resolve`` reads, or name the session directly.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from kvproxy.sessions.identity import Session, explicit_id, short_hash, text_of

INFILL_SESSION = "infill"


# -- OpenAI Responses API ------------------------------------------------------
def responses_messages(body: Mapping[str, Any]) -> list[dict]:
    """The conversation of a Responses request as chat messages, as llama-server reads it:
    ``instructions`` first as the system prompt, then ``input`` (a text or a list of items).
    Items without a role (tool calls, their outputs, reasoning) carry no identity."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if isinstance(item, Mapping) and isinstance(item.get("role"), str):
                messages.append({"role": item["role"], "content": _item_text(item.get("content"))})
    return messages


def _item_text(content: Any) -> str:
    """Text of an item's content: a string or a list of input_text/output_text parts."""
    return text_of(content) if isinstance(content, (str, list)) else ""


def conversation_id(body: Mapping[str, Any]) -> str | None:
    """The Responses API's ``conversation``: an id string or ``{"id": ...}``."""
    conversation = body.get("conversation")
    if isinstance(conversation, Mapping):
        conversation = conversation.get("id")
    return conversation if isinstance(conversation, str) and conversation.strip() else None


def responses_identity_body(body: Mapping[str, Any]) -> dict:
    """The fields ``identity.resolve`` reads ids from: the body, with ``conversation`` as the
    conversation id. A named conversation outranks ``user`` (it names a person, and every
    conversation of that person would share one slot file)."""
    fields = dict(body)
    conversation = conversation_id(body)
    if conversation:
        fields["conversation_id"] = conversation
        fields.pop("user", None)
    return fields


# -- fill-in-the-middle (/infill) ----------------------------------------------
def infill_session(headers: Mapping[str, str], body: Mapping[str, Any],
                   header_names: Iterable[str]) -> Session:
    """One session per editor, and per file when the request names one.

    Editor plugins (llama.vscode, llama.vim) send no conversation id and do not name the
    file being edited: ``input_extra`` holds chunks of recently used files, shared by every
    request and placed first in the prompt. So the reusable prefix belongs to the editor,
    and an editor keeps one infill session, apart from its chats. A client that sends a
    session header (or a body id) gets its own; one that sends ``filename`` gets one per file.
    """
    named = explicit_id(headers, body, header_names)
    filename = body.get("filename")
    file_part = short_hash(filename) if isinstance(filename, str) and filename else ""
    suffix = "#infill" + (f"-{file_part}" if file_part else "")
    if named:
        return Session(named[0], f"infill:{named[1]}", key=named[0] + suffix)
    return Session(INFILL_SESSION, "infill", key=INFILL_SESSION + suffix)
