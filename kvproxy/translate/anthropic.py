"""Anthropic Messages API <-> llama-server's OpenAI-style chat format.

Pure functions and one small stream state machine: no Flask, no I/O, so the
whole dialect can be tested by feeding dicts. Requests go to llama-server's
``/v1/chat/completions`` (not its own ``/v1/messages``) so every dialect gets
the same ``timings`` and the slot fields are honoured.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Iterable, Iterator

from kvproxy.errors import ClientError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 502: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}

# Claude Code stamps its system prompt with a per-request checksum (cch=xxxxx;).
# Left alone it changes the first tokens of every prompt and no cache survives.
_BILLING = re.compile(r"^(x-anthropic-billing-header:[^\n]*?cch=)[^;\s]*;")

# Fields a token count needs; sampling fields do not change the prompt.
_PROMPT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls",
                  "chat_template_kwargs", "reasoning_effort")
# What llama-server's own /v1/messages uses when a request names no max_tokens.
DEFAULT_MAX_TOKENS = 4096


# -- errors -----------------------------------------------------------------
def error_body(status: int, message: str) -> dict:
    """Anthropic's error object; the type must agree with the status."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# -- request ----------------------------------------------------------------
def to_llama(body: dict, *, count_only: bool = False) -> dict:
    """The llama-server chat body for an Anthropic request (``count_only``: prompt fields only)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError("messages: a non-empty list of messages is required")
    out: dict[str, Any] = {"messages": _system(body.get("system")) + _messages(messages)}
    out.update(_tools(body.get("tools"), body.get("tool_choice")))
    out.update(_thinking(body.get("thinking")))
    out.update(_effort(body.get("output_config")))
    if count_only:
        return {key: out[key] for key in _PROMPT_FIELDS if key in out}
    out.update(_sampling(body))
    return out


def _system(system: Any) -> list[dict]:
    """The system prompt as one leading system message (string or text blocks).

    Any other shape is skipped, as llama-server's own /v1/messages does.
    """
    text = "\n".join(_BILLING.sub(r"\g<1>00000;", part) for part in _texts(system))
    return [{"role": "system", "content": text}] if text else []


def _texts(content: Any) -> list[str]:
    """The texts of a string or of the text blocks in a list; nothing for other shapes."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text"
                and isinstance(b.get("text"), str)]
    return []


def _messages(messages: list) -> list[dict]:
    out: list[dict] = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ClientError(f"messages.{number}: must be an object")
        role, content = message.get("role"), message.get("content")
        if role in ("system", "developer"):
            # Claude Code 2.1 sends its environment as a system message after the first
            # user turn; it stays where it stands, as llama-server's own route keeps it.
            if text := "\n".join(_texts(content)):
                out.append({"role": "system", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise ClientError(
                f"messages.{number}.role: must be 'user', 'assistant' or 'system'")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out.extend(_assistant(content) if role == "assistant" else _user(content))
        else:
            raise ClientError(f"messages.{number}.content: must be a string or a list of blocks")
    return out


def _user(blocks: list) -> list[dict]:
    """Tool results become ``tool`` messages, which must directly follow the tool calls."""
    results, parts = [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _result_content(block)})
        elif isinstance(block, dict) and (part := _part(block)):
            parts.append(part)
    if parts:
        results.append({"role": "user", "content": _collapse(parts)})
    return results


# What llama-server's own /v1/messages assumes when an image names no media type.
DEFAULT_IMAGE_TYPE = "image/jpeg"


def _part(block: dict) -> dict | None:
    """One OpenAI content part for a text, image or plain-text document block.

    Images become ``image_url`` parts with a ``data:`` URL (or the block's URL), as
    llama-server's own /v1/messages sends them, in user messages and tool results alike:
    a vision model sees a tool's screenshot, a text-only one refuses it."""
    kind, source = block.get("type"), block.get("source")
    if kind == "text" and isinstance(block.get("text"), str):
        return {"type": "text", "text": block["text"]}
    if not isinstance(source, dict):
        return None
    if kind == "image" and source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") or DEFAULT_IMAGE_TYPE
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source['data']}"}}
    if kind == "image" and source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    if kind == "document" and source.get("type") == "text" and isinstance(source.get("data"), str):
        return {"type": "text", "text": source["data"]}
    return None


def _collapse(parts: list[dict]) -> str | list[dict]:
    """Text-only content as one string: every chat template renders that."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _result_content(block: dict) -> str | list[dict]:
    """A tool result's content: one string when it is text only, else the parts with
    its images, as llama-server's own route sends a multimodal tool message."""
    content = block.get("content")
    if isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = [p for p in (_part(b) for b in content if isinstance(b, dict)) if p]
    else:
        parts = []
    if block.get("is_error"):
        parts.insert(0, {"type": "text", "text": "Error:"})
    return _collapse(parts) if parts else ""


def _assistant(blocks: list) -> list[dict]:
    texts, thinking, calls = [], [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "tool_use":
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": str(block.get("name", "")),
                                       "arguments": json.dumps(block.get("input") or {},
                                                               ensure_ascii=False)}})
    if not (texts or thinking or calls):
        return []
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tools(tools: Any, choice: Any) -> dict:
    """Client tools in OpenAI function form; server tools without a schema are skipped."""
    functions = [{"type": "function",
                  "function": {"name": t["name"], "description": t.get("description") or "",
                               "parameters": t["input_schema"]}}
                 for t in (tools if isinstance(tools, list) else [])
                 if isinstance(t, dict) and isinstance(t.get("name"), str)
                 and isinstance(t.get("input_schema"), dict)]
    if not functions:
        return {}
    out: dict[str, Any] = {"tools": functions}
    choice = choice if isinstance(choice, dict) else {}
    kind = choice.get("type", "auto")
    if kind == "tool":
        named = [f for f in functions if f["function"]["name"] == choice.get("name")]
        if not named:
            raise ClientError(f"tool_choice.name: no tool named {choice.get('name')!r}")
        out["tools"] = named  # the only way to force one function on llama-server
    out["tool_choice"] = {"auto": "auto", "none": "none"}.get(kind, "required")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _thinking(thinking: Any) -> dict:
    """Extended thinking as the chat template's switch plus llama-server's reasoning budget.

    ``adaptive`` (Claude Code's default: the model decides) keeps the server's own
    reasoning setting, as llama-server's /v1/messages does; ``display`` is not used.
    """
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind != "enabled":
        return {}
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
    budget = thinking.get("budget_tokens")
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
        out["thinking_budget_tokens"] = budget
    return out


def _effort(config: Any) -> dict:
    """``output_config.effort`` as llama-server's ``reasoning_effort`` (templates such as
    gpt-oss read it; others ignore it). Efforts beyond ``high`` ask for ``high``."""
    effort = config.get("effort") if isinstance(config, dict) else None
    mapped = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high",
              "max": "high"}.get(effort) if isinstance(effort, str) else None
    return {"reasoning_effort": mapped} if mapped else {}


def _sampling(body: dict) -> dict:
    # The Messages API makes max_tokens required; llama-server's own route defaults it
    # to 4096, and kvproxy answers whatever llama-server answers.
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ClientError("max_tokens: must be an integer of at least 1")
    out: dict[str, Any] = {"max_tokens": max_tokens}
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            if not isinstance(body[key], (int, float)) or isinstance(body[key], bool):
                raise ClientError(f"{key}: must be a number")
            out[key] = body[key]
    config = body.get("output_config")
    schema_format = config.get("format") if isinstance(config, dict) else None
    if isinstance(schema_format, dict) and isinstance(schema_format.get("schema"), dict):
        # Structured outputs: llama-server turns the schema into a grammar.
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"schema": schema_format["schema"]}}
    stops = stop_sequences(body)
    if stops:
        # verbose + response_fields make llama-server say which stop string ended the answer.
        out.update(stop=stops, verbose=True, response_fields=["stop_type", "stopping_word"])
    return out


def stop_sequences(body: dict) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ClientError("stop_sequences: must be a list of strings")
    return [s for s in stops if s]


# -- response ---------------------------------------------------------------
def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def stop_reason(finish: str | None, verbose: Any, stops: Iterable[str],
                tool_calls: bool) -> tuple[str, str | None]:
    """Anthropic stop_reason and stop_sequence from llama-server's finish and stop word.

    Template stop strings (e.g. ``<|im_end|>``) also count as words upstream,
    so only a client's own sequence is reported as ``stop_sequence``.
    """
    if finish == "length":
        return "max_tokens", None
    if tool_calls or finish == "tool_calls":
        return "tool_use", None
    verbose = verbose if isinstance(verbose, dict) else {}
    word = verbose.get("stopping_word")
    if verbose.get("stop_type") == "word" and word and word in set(stops):
        return "stop_sequence", word
    return "end_turn", None


def usage(timings: Any, openai_usage: Any = None) -> dict:
    """Token figures of the request: cache_n reused, prompt_n computed (a base prefill of its
    swap counted as computed: ``translate.usage``)."""
    t = timings if isinstance(timings, dict) else {}
    u = openai_usage if isinstance(openai_usage, dict) else {}
    cached = t.get("cache_n")
    if cached is None:
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    computed = t.get("prompt_n")
    if computed is None:
        computed = max(0, (u.get("prompt_tokens") or 0) - cached)
    output = t.get("predicted_n", u.get("completion_tokens", 0))
    return {"input_tokens": int(computed), "output_tokens": int(output or 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": int(cached or 0)}


def tool_input(arguments: Any) -> dict:
    """A tool call's arguments as an object; unparsable text is kept rather than lost."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except (TypeError, ValueError):
        return {"_raw_arguments": str(arguments)}
    return value if isinstance(value, dict) else {"value": value}


def to_message(result: dict, model: str, stops: Iterable[str] = ()) -> dict:
    """A whole Anthropic Message from llama-server's non-streamed chat completion."""
    choice = (result.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": str(message["content"])})
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or new_id("toolu_"),
                        "name": function.get("name", ""),
                        "input": tool_input(function.get("arguments"))})
    if not content:
        content.append({"type": "text", "text": ""})
    reason, sequence = stop_reason(choice.get("finish_reason"), result.get("__verbose"),
                                   stops, bool(calls))
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(result.get("timings"), result.get("usage"))}


# -- stream -----------------------------------------------------------------
def sse(event: str, data: dict) -> bytes:
    """One server-sent event; the SDKs skip any event without its ``event:`` line."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def stream_error(status: int, message: str) -> bytes:
    return sse("error", error_body(status, message))


class StreamTranslator:
    """Turns OpenAI chat chunks into Anthropic's event sequence.

    One block is open at a time; a change of kind (thinking, text, a new tool
    call) closes it and opens the next, so indices stay 0-based and contiguous.
    message_start goes out with the first upstream chunk: llama-server sends
    nothing before its first token, and that chunk's ``timings`` (requested with
    ``timings_per_token``) hold the prompt and cache figures. message_delta
    repeats them with the output count; the SDKs merge both into the message.
    """

    def __init__(self, model: str, stops: Iterable[str] = ()):
        self.model, self.stops, self.index = model, list(stops), -1
        self.open: Any = None  # "text", "thinking", ("tool", upstream index) or None
        self.args_sent = self.tool_calls = self.started = False
        self.finish: str | None = None
        self.verbose = self.timings = self.openai_usage = None

    def start(self) -> Iterator[bytes]:
        """message_start (once) with the prompt figures known so far."""
        if self.started:
            return
        self.started = True
        figures = {**usage(self.timings, self.openai_usage), "output_tokens": 0}
        message = {"id": new_id("msg_"), "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": figures}
        yield sse("message_start", {"type": "message_start", "message": message})
        yield sse("ping", {"type": "ping"})

    def feed(self, chunk: dict) -> Iterator[bytes]:
        """Events for one upstream chunk.

        llama-server sends the first token as two events, a bare role delta and then
        the token with the timings: message_start waits for the second.
        """
        self.timings = chunk.get("timings", self.timings)
        if self.timings is not None or _has_output(chunk):
            yield from self.start()
        self.verbose = chunk.get("__verbose", self.verbose)
        self.openai_usage = chunk.get("usage", self.openai_usage)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._text("thinking", delta["reasoning_content"])
            if delta.get("content"):
                yield from self._text("text", delta["content"])
            for call in delta.get("tool_calls") or []:
                yield from self._tool(call)
            self.finish = choice.get("finish_reason") or self.finish

    def end(self) -> Iterator[bytes]:
        """Close the last block and report why the answer stopped and what it cost."""
        yield from self.start()
        if self.finish is None:
            yield from self._close()
            yield stream_error(502, "llama-server ended the stream before the answer finished")
            return
        if self.index < 0:
            yield from self._text("text", "")
        yield from self._close()
        reason, sequence = stop_reason(self.finish, self.verbose, self.stops, self.tool_calls)
        yield sse("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": usage(self.timings, self.openai_usage)})
        yield sse("message_stop", {"type": "message_stop"})

    def _open(self, kind: Any, block: dict) -> Iterator[bytes]:
        yield from self._close()
        self.index += 1
        self.open = kind
        yield sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                          "content_block": block})

    def _close(self) -> Iterator[bytes]:
        if self.open is None:
            return
        if isinstance(self.open, tuple) and not self.args_sent:
            yield self._delta({"type": "input_json_delta", "partial_json": "{}"})
        self.open = None
        yield sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                           "delta": delta})

    def _text(self, kind: str, text: str) -> Iterator[bytes]:
        if self.open != kind:
            extra = {"signature": ""} if kind == "thinking" else {}
            yield from self._open(kind, {"type": kind, kind: "", **extra})
        if text:
            yield self._delta({"type": f"{kind}_delta", kind: text})

    def _tool(self, call: dict) -> Iterator[bytes]:
        function = call.get("function") or {}
        key = ("tool", call.get("index", 0))
        if self.open != key:
            self.tool_calls = True
            block_id = call.get("id") or new_id("toolu_")
            yield from self._open(key, {"type": "tool_use", "id": block_id,
                                        "name": function.get("name") or "", "input": {}})
            self.args_sent = False
        if function.get("arguments"):
            self.args_sent = True
            yield self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})


def _has_output(chunk: dict) -> bool:
    """Whether a chunk carries text, reasoning, a tool call or the finish."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                or choice.get("finish_reason")):
            return True
    return False


def stream_events(events: Iterable[tuple[bytes, dict | None]], model: str,
                  stops: Iterable[str] = ()) -> Iterator[bytes]:
    """Anthropic SSE bytes for llama-server's OpenAI stream (``None`` is ``[DONE]``)."""
    translator = StreamTranslator(model, stops)
    for _raw, chunk in events:
        if chunk is None:
            break
        yield from translator.feed(chunk)
    yield from translator.end()
