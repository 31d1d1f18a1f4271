"""Ollama wire format to llama-server's OpenAI-style bodies, and its answers back.

Pure functions over plain dicts (no Flask, no network), so every rule that
real clients depend on can be tested on its own. The routes in ``ollama.py``
do the I/O and call these.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Iterator

from kvproxy.errors import ClientError
from kvproxy.upstream.llama import UpstreamError


# Ollama option -> (llama-server body field, expected type). Anything else is ignored,
# as Ollama ignores options a runner does not use (num_ctx, num_gpu, ...).
OPTIONS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
    "min_p": ("min_p", float), "typical_p": ("typical_p", float),
    "num_predict": ("max_tokens", int), "seed": ("seed", int),
    "repeat_penalty": ("repeat_penalty", float), "repeat_last_n": ("repeat_last_n", int),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float), "mirostat": ("mirostat", int),
    "mirostat_tau": ("mirostat_tau", float), "mirostat_eta": ("mirostat_eta", float),
    "num_keep": ("n_keep", int),
}
THINK_LEVELS = ("low", "medium", "high")
_ZERO_DURATION = re.compile(r"^-?0+(\.0+)?(ns|us|µs|ms|s|m|h)?$")
_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"),
                (b"RIFF", "image/webp"), (b"BM", "image/bmp"))


def created_at(now: datetime | None = None) -> str:
    """Ollama's timestamp: ISO 8601 in UTC with a Z."""
    now = now or datetime.now(timezone.utc)
    return now.isoformat(timespec="microseconds").replace("+00:00", "Z")


# -- requests ---------------------------------------------------------------
def _number(name: str, value: Any, kind: type) -> int | float:
    """Ollama (Go) refuses a wrongly typed option; so do we, with a 400 instead of a 500."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClientError(f"option '{name}' must be a number, got {json.dumps(value)}")
    if kind is int:
        if value != int(value):
            raise ClientError(f"option '{name}' must be a whole number, got {value}")
        return int(value)
    return float(value)


def translate_options(options: Any) -> dict:
    """Ollama ``options`` as llama-server sampling fields."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ClientError("'options' must be an object")
    body: dict = {}
    for name, value in options.items():
        if value is None:
            continue
        if name == "stop":
            body["stop"] = _stops(value)
        elif name in OPTIONS:
            field, kind = OPTIONS[name]
            body[field] = _number(name, value, kind)
    if body.get("max_tokens", 0) < 0:  # -1 "until done", -2 "fill the context": llama's default
        del body["max_tokens"]
    return body


def _stops(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise ClientError("option 'stop' must be a string or a list of strings")


def translate_format(fmt: Any) -> dict | None:
    """``format`` "json" or a JSON schema as an OpenAI ``response_format``."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise ClientError(f"invalid format {json.dumps(fmt)}: use \"json\" or a JSON schema object")


def translate_think(think: Any) -> dict:
    """``think`` as llama-server's template switch; reasoning comes back as reasoning_content."""
    if think is None:
        return {}
    if think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if think is True or think in THINK_LEVELS:
        body: dict = {"chat_template_kwargs": {"enable_thinking": True},
                      "reasoning_format": "deepseek"}
        if think in THINK_LEVELS:
            body["reasoning_effort"] = think
        return body
    raise ClientError(f"invalid think value {json.dumps(think)}: use true, false, "
                  + ", ".join(f'"{level}"' for level in THINK_LEVELS))


def image_part(image: Any, position: int) -> dict:
    """One base64 image as an OpenAI ``image_url`` part with a data URL."""
    if not isinstance(image, str):
        raise ClientError(f"image {position} must be a base64 string")
    data = image.split(",", 1)[1] if image.startswith("data:") else image
    try:
        head = base64.b64decode(data, validate=True)[:8]
    except (binascii.Error, ValueError):
        raise ClientError(f"image {position} is not valid base64") from None
    mime = next((kind for magic, kind in _IMAGE_MAGIC if head.startswith(magic)), "image/jpeg")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def _content(message: dict, vision: bool) -> Any:
    text = message.get("content")
    text = "" if text is None else text
    if not isinstance(text, str):
        raise ClientError("message 'content' must be a string")
    images = message.get("images") or []
    if not images:
        return text
    if not vision:
        raise ClientError("this model does not accept images: llama-server reports no vision "
                      "modality in /props (start it with a --mmproj projector for a vision model)")
    return [{"type": "text", "text": text}] + [image_part(img, i) for i, img in enumerate(images)]


def _openai_tool_call(call: Any, index: int) -> dict:
    """Ollama's tool call (arguments an object) as OpenAI's (arguments a JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ClientError("every tool call needs function.name")
    arguments = function.get("arguments") or {}
    return {"id": call.get("id") or f"call_{index}", "type": "function",
            "function": {"name": function["name"], "arguments": arguments
                         if isinstance(arguments, str) else json.dumps(arguments)}}


def translate_messages(messages: Any, vision: bool) -> list[dict]:
    """Ollama chat messages (images, thinking, tool calls, tool results) in OpenAI shape."""
    if not isinstance(messages, list):
        raise ClientError("'messages' must be a list")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ClientError("every message must be an object with a 'role'")
        item: dict = {"role": message["role"], "content": _content(message, vision)}
        if message.get("thinking") and message["role"] == "assistant":
            item["reasoning_content"] = message["thinking"]
        if message.get("tool_calls"):
            item["tool_calls"] = [_openai_tool_call(c, i)
                                  for i, c in enumerate(message["tool_calls"])]
        if message.get("tool_name"):
            item["name"] = message["tool_name"]
        if message.get("tool_call_id"):
            item["tool_call_id"] = message["tool_call_id"]
        out.append(item)
    return out


def _sampling(req: dict) -> dict:
    body = translate_options(req.get("options"))
    response_format = translate_format(req.get("format"))
    if response_format:
        body["response_format"] = response_format
    return body


def chat_body(req: dict, vision: bool) -> dict:
    """The llama-server /v1/chat/completions body for an Ollama /api/chat request."""
    body = {"messages": translate_messages(req.get("messages") or [], vision), **_sampling(req)}
    tools = req.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ClientError("'tools' must be a list of objects")
        body["tools"] = [{"type": "function", **tool} for tool in tools]
    body.update(translate_think(req.get("think")))
    return body


def generate_call(req: dict, vision: bool) -> tuple[str, dict]:
    """Path and body for /api/generate.

    Templated prompts go through chat completions (system + user message), so they get the
    same template, thinking and session identity as /api/chat. ``raw`` sends the prompt as
    is to /v1/completions, where a format becomes ``json_schema`` (response_format is
    ignored there).
    """
    prompt, system = req.get("prompt") or "", req.get("system") or ""
    if not isinstance(prompt, str) or not isinstance(system, str):
        raise ClientError("'prompt' and 'system' must be strings")
    if req.get("suffix"):
        raise ClientError("'suffix' (fill-in-the-middle) is not supported by kvproxy")
    if req.get("raw"):
        if req.get("images"):
            raise ClientError("images need a templated prompt: send them without raw:true")
        body = {"prompt": prompt, **translate_options(req.get("options"))}
        response_format = translate_format(req.get("format"))
        if response_format:
            body["json_schema"] = (response_format.get("json_schema") or {}).get(
                "schema", {"type": "object"})
        return "/v1/completions", body
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": prompt, "images": req.get("images")}]
    body = {"messages": translate_messages(messages, vision), **_sampling(req)}
    body.update(translate_think(req.get("think")))
    return "/v1/chat/completions", body


def unloads(keep_alive: Any) -> bool:
    """keep_alive 0 (number or duration string) asks Ollama to unload the model."""
    if isinstance(keep_alive, bool):
        return False
    if isinstance(keep_alive, (int, float)):
        return keep_alive == 0
    return isinstance(keep_alive, str) and bool(_ZERO_DURATION.match(keep_alive.strip()))


def load_reply(kind: str, model: str, keep_alive: Any) -> dict:
    """Answer to an empty chat/generate: Ollama's "load the model" call; the slot is untouched."""
    reply: dict = {"model": model, "created_at": created_at()}
    if kind == "chat":
        reply["message"] = {"role": "assistant", "content": ""}
    else:
        reply["response"] = ""
    reply.update(done=True, done_reason="unload" if unloads(keep_alive) else "load")
    return reply


# -- answers ----------------------------------------------------------------
def done_reason(finish_reason: Any) -> str:
    """Ollama knows "stop" and "length"; a tool call ends with "stop" there too."""
    return "length" if finish_reason == "length" else "stop"


def _ns(ms: Any) -> int:
    return max(0, round(float(ms or 0) * 1_000_000))


def durations(timings: dict, usage: dict, started_ns: int, now_ns: int) -> dict:
    """Ollama's counters in integer nanoseconds, from llama-server's ``timings``.

    prompt_eval_count is what was computed for the request (prompt_n; with a base prefill of
    its swap counted in, and its time in prompt_ms: ``translate.usage``), so a cached prompt
    shows as a small count. load_duration is the part of the wall time outside evaluation:
    waiting for the slot and swapping the session's KV state in.
    """
    usage = usage or {}
    prompt_ns, eval_ns = _ns(timings.get("prompt_ms")), _ns(timings.get("predicted_ms"))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    prompt_n = timings.get("prompt_n", (usage.get("prompt_tokens") or 0) - cached)
    eval_n = timings.get("predicted_n", usage.get("completion_tokens") or 0)
    total = max(int(now_ns - started_ns), prompt_ns + eval_ns)
    return {"total_duration": total, "load_duration": total - prompt_ns - eval_ns,
            "prompt_eval_count": int(prompt_n), "prompt_eval_duration": prompt_ns,
            "eval_count": int(eval_n), "eval_duration": eval_ns}


def tool_arguments(arguments: Any) -> dict:
    """OpenAI's JSON-string arguments as the object Ollama clients expect."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        return {"raw": arguments}  # the model wrote no valid JSON: keep its text visible
    return parsed if isinstance(parsed, dict) else {"value": parsed}


def ollama_tool_calls(calls: Iterable[dict]) -> list[dict]:
    out = []
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        item: dict = {"function": {"index": index, "name": function.get("name") or "",
                                   "arguments": tool_arguments(function.get("arguments"))}}
        if call.get("id"):
            item["id"] = call["id"]
        out.append(item)
    return out


def _piece(kind: str, model: str, text: str, thinking: str | None = None,
           tool_calls: list | None = None) -> dict:
    """One Ollama object: chat carries ``message`` (role always set), generate ``response``."""
    obj: dict = {"model": model, "created_at": created_at()}
    if kind == "chat":
        message: dict = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if tool_calls:
            message["tool_calls"] = tool_calls
        obj["message"] = message
    else:
        obj["response"] = text
        if thinking:
            obj["thinking"] = thinking
    obj["done"] = False
    return obj


def _final(kind: str, model: str, finish: Any, timing_fields: dict, text: str = "",
           thinking: str | None = None, tool_calls: list | None = None) -> dict:
    obj = _piece(kind, model, text, thinking, tool_calls)
    obj.update(done=True, done_reason=done_reason(finish), **timing_fields)
    if kind == "generate":
        obj["context"] = []  # token context is not kept: kvproxy caches by session instead
    return obj


def full_reply(kind: str, result: dict, model: str, started_ns: int, now_ns: int,
               keep_thinking: bool = True) -> dict:
    """A whole (stream:false) llama-server answer as one Ollama object."""
    choice = (result.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = message.get("content") if "message" in choice else choice.get("text")
    thinking = message.get("reasoning_content") if keep_thinking else None
    calls = ollama_tool_calls(message.get("tool_calls") or []) if kind == "chat" else None
    return _final(kind, model, choice.get("finish_reason"),
                  durations(result.get("timings") or {}, result.get("usage") or {},
                            started_ns, now_ns), text or "", thinking, calls)


def _gather_tool_calls(calls: dict[int, dict], deltas: Any) -> None:
    """llama-server streams a tool call's arguments in fragments; Ollama sends it whole."""
    for delta in deltas or []:
        entry = calls.setdefault(delta.get("index", len(calls)),
                                 {"id": None, "function": {"name": "", "arguments": ""}})
        entry["id"] = delta.get("id") or entry["id"]
        function = delta.get("function") or {}
        entry["function"]["name"] += function.get("name") or ""
        entry["function"]["arguments"] += function.get("arguments") or ""


def stream_objects(events: Iterable[tuple[bytes, dict | None]], *, kind: str, model: str,
                   started_ns: int, clock: Callable[[], int],
                   keep_thinking: bool = True) -> Iterator[dict]:
    """Ollama stream objects for llama-server's OpenAI chunks, ending with the done object.

    Raises UpstreamError when the stream ends before llama-server said it was finished,
    so the client gets an error line instead of a silently cut answer.
    """
    calls: dict[int, dict] = {}
    finish, timings, usage = None, {}, {}
    for _raw, chunk in events:
        if chunk is None:
            break
        timings, usage = chunk.get("timings") or timings, chunk.get("usage") or usage
        for choice in (chunk.get("choices") or [])[:1]:
            delta = choice.get("delta") or {}
            text = delta.get("content") if "delta" in choice else choice.get("text")
            thinking = delta.get("reasoning_content") if keep_thinking else None
            _gather_tool_calls(calls, delta.get("tool_calls"))
            finish = choice.get("finish_reason") or finish
            if text or thinking:
                yield _piece(kind, model, text or "", thinking)
    if finish is None:
        raise UpstreamError(502, "llama-server ended the stream before the answer was complete")
    if calls and kind == "chat":
        yield _piece(kind, model, "", tool_calls=ollama_tool_calls(
            calls[i] for i in sorted(calls)))
    yield _final(kind, model, finish, durations(timings, usage, started_ns, clock()))
