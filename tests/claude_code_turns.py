"""A multi-turn Claude Code session built from the recorded requests, adapted per turn.

Turns 1 and 2 are the recorded first and resumed requests. Turns 3 and 4 continue the
resumed one the way a longer session does: an assistant answer with a thinking block,
a new system message in the middle of the conversation, one tool removed, then the old
thinking block trimmed (``context_management``'s clear_thinking) and a tool added back
under another name. ``shrink`` cuts long texts, so the whole session fits a small
context (the bundled model has 8192 tokens; Claude Code's own prompt is larger).
"""
from __future__ import annotations

import copy
from typing import Any

NEW_TOOL = {"name": "Fetch", "description": "Fetch a URL.",
            "input_schema": {"type": "object", "properties": {"url": {"type": "string"}},
                             "required": ["url"]}}


def shrink_texts(value: Any, limit: int) -> Any:
    """Every string longer than ``limit`` cut to ``limit`` characters, recursively."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list):
        return [shrink_texts(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: shrink_texts(v, limit) for k, v in value.items()}
    return value


def small_tools(tools: list[dict], keep: int) -> list[dict]:
    """The first ``keep`` tools with a one-line description and an empty schema."""
    return [{"name": t["name"], "description": (t.get("description") or "")[:80],
             "input_schema": {"type": "object", "properties": {}}} for t in tools[:keep]]


def turns(records: list[dict], shrink: int | None = None, keep_tools: int = 4) -> list[dict]:
    """Four requests ``{"path", "headers", "body"}`` of one Claude Code session."""
    first, resumed = (copy.deepcopy(r) for r in records[:2])
    for record in (first, resumed):
        if shrink:
            body = record["body"]
            body["system"] = shrink_texts(body["system"], shrink)
            body["messages"] = shrink_texts(body["messages"], shrink)
            body["tools"] = small_tools(body.get("tools") or [], keep_tools)
        record["body"]["max_tokens"] = 4
        record["body"]["temperature"] = 0
    third = copy.deepcopy(resumed)
    body = third["body"]
    body["messages"] += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The user wants a short answer.", "signature": "s"},
            {"type": "text", "text": "Bonjour !"}]},
        {"role": "system", "content": "<system-reminder>The user changed the mode.</system-reminder>"},
        {"role": "user", "content": [{"type": "text", "text": "And in German?"}]}]
    if body.get("tools"):
        body["tools"] = body["tools"][:-1]
    fourth = copy.deepcopy(third)
    body = fourth["body"]
    for message in body["messages"]:
        if message["role"] == "assistant" and isinstance(message["content"], list):
            message["content"] = [b for b in message["content"] if b.get("type") != "thinking"]
    body["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": "Hallo!"}]},
                         {"role": "user", "content": "Thanks."}]
    body["tools"] = (body.get("tools") or []) + [NEW_TOOL]
    return [first, resumed, third, fourth]


def anonymous(record: dict) -> dict:
    """The same request without any session id (no header, no metadata.user_id)."""
    record = copy.deepcopy(record)
    record["headers"] = {k: v for k, v in record["headers"].items()
                         if k.lower() != "x-claude-code-session-id"}
    record["body"].pop("metadata", None)
    return record
