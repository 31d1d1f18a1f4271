"""The differential conformance check: one request, sent to llama-server and to kvproxy.

Answers are compared by form, not by value: the status class, the key paths of
a JSON body, and for streams the names of the events in order (repeated deltas
collapsed into one). Corpus entries are JSON files ``{"method", "path",
"headers", "body"}`` plus optional ``"raw"`` (a body sent as text) and
``"expect"`` hints:
  ``{"direct": false}``   only kvproxy is asked (a route llama-server lacks)
  ``{"status": 4}``       the status class both sides must answer
  ``{"extra": "why"}``    kvproxy may add keys to a successful answer (say why)
  ``{"extra_events": ["ping"], "why": "..."}``  events kvproxy may add to a stream
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"
# Headers that belong to one hop, not to the request a client meant.
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding",
               "keep-alive"}
# Generation is capped to keep the suite quick; the cap changes lengths, never forms.
# It is greedy where the client sent no temperature, so both sides answer the same tokens:
# llama-server's own Responses stream repeats response.created / response.in_progress in
# the middle for some sampled answers (1 of 8 replays of the recorded Codex request, none
# of 10 greedy ones), which would make two sampled answers differ in form by chance.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")
MAX_TOKENS = 8
# Ollama's API: llama-server does not speak it, so only kvproxy is asked.
OLLAMA_PATHS = ("/api/",)


@dataclass
class Entry:
    name: str
    method: str
    path: str
    headers: dict = field(default_factory=dict)
    body: Any = None
    raw: str | None = None
    expect: dict = field(default_factory=dict)

    @property
    def direct(self) -> bool:
        """Whether llama-server itself is asked too."""
        if self.path == "/" or self.path.startswith(OLLAMA_PATHS):
            return False
        return self.expect.get("direct", True)

    def request_kwargs(self) -> dict:
        headers = {k: v for k, v in (self.headers or {}).items() if k.lower() not in HOP_HEADERS}
        kwargs: dict = {"headers": headers}
        if self.raw is not None:
            kwargs["data"] = self.raw.encode()
            headers.setdefault("Content-Type", "application/json")
        elif self.body is not None:
            kwargs["data"] = json.dumps(
                bounded(self.body, ollama=self.path.startswith(OLLAMA_PATHS))).encode()
            if not any(k.lower() == "content-type" for k in headers):
                headers["Content-Type"] = "application/json"
        return kwargs


def bounded(body: Any, ollama: bool = False) -> Any:
    """The body with generation lengths capped at MAX_TOKENS (Ollama's options too), and
    greedy unless it names a temperature.

    An Ollama request reads only ``options.num_predict``, so ``ollama`` adds it where the
    client sent none (OpenWebUI's follow-up task asks for an answer of any length)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    generates = any(k in body for k in ("messages", "input", "prompt", "input_prefix"))
    if generates and not any(name in body for name in LENGTH_FIELDS):
        body["max_tokens"] = MAX_TOKENS
    for name in LENGTH_FIELDS:
        if isinstance(body.get(name), int) and (body[name] < 0 or body[name] > MAX_TOKENS):
            body[name] = MAX_TOKENS
    if isinstance(body.get("options"), dict) or (ollama and generates):
        body["options"] = {"temperature": 0, **(body.get("options") or {}),
                           "num_predict": MAX_TOKENS}
    elif generates:
        body.setdefault("temperature", 0)
    return body


def load_corpus(root: Path = FIXTURES) -> list[Entry]:
    """Hand-made cases (conformance/*.json) and recorded client requests (recorded/*/*.json)."""
    files = sorted(root.glob("conformance/*.json")) + sorted(root.glob("recorded/*/*.json"))
    entries = []
    for path in files:
        data = json.loads(path.read_text())
        entries.append(Entry(name=str(path.relative_to(root)), method=data.get("method", "POST"),
                             path=data["path"], headers=data.get("headers") or {},
                             body=data.get("body"), raw=data.get("raw"),
                             expect=data.get("expect") or {}))
    return entries


# -- forms ----------------------------------------------------------------------
def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON value; lists contribute the union of their items' paths.
    A leaf is named by its kind (null or value), so a null where an object was differs."""
    if isinstance(value, dict):
        paths = {prefix + "{}"} if not value else set()
        for key, item in value.items():
            paths |= key_paths(item, f"{prefix}.{key}" if prefix else str(key))
        return paths
    if isinstance(value, list):
        paths = {prefix + "[]"}
        for item in value:
            paths |= key_paths(item, prefix + "[]")
        return paths
    return {f"{prefix}:{'null' if value is None else 'value'}"}


def stream_events(text: str) -> list[str]:
    """Names of the events of an SSE body in order, consecutive repeats collapsed.

    An event is named by its ``event:`` line, else by its ``type`` field, else (OpenAI
    chunks) by its key paths, so a role chunk, content deltas and the final chunk differ.
    """
    names: list[str] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        event, data = None, None
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        if event is None and data is None:
            continue
        if event is None:
            if data == "[DONE]":
                event = "[DONE]"
            else:
                try:
                    parsed = json.loads(data)
                except ValueError:
                    parsed = data
                event = parsed.get("type") if isinstance(parsed, dict) and \
                    isinstance(parsed.get("type"), str) else ",".join(sorted(key_paths(parsed)))
        if not names or names[-1] != event:
            names.append(event)
    return names


@dataclass
class Form:
    status: int
    kind: str          # "json", "sse" or "text"
    events: list[str] = field(default_factory=list)
    paths: set[str] = field(default_factory=set)

    @property
    def status_class(self) -> int:
        return self.status // 100


def form_of(status: int, content_type: str, text: str) -> Form:
    if "text/event-stream" in content_type:
        return Form(status, "sse", events=stream_events(text))
    try:
        return Form(status, "json", paths=key_paths(json.loads(text)))
    except ValueError:
        return Form(status, "text")


def differences(direct: Form, proxied: Form, expect: dict | None = None) -> list[str]:
    """What a client would notice: another status class, another kind of body, keys or
    events missing or added. An error may carry more keys through kvproxy (OpenAI's
    ``param``), never fewer; other additions only where ``expect`` allows them."""
    expect = expect or {}
    found = []
    added_events = set(expect.get("extra_events") or ())
    if added_events:
        proxied = Form(proxied.status, proxied.kind, paths=proxied.paths,
                       events=[e for e in proxied.events if e not in added_events])
    if direct.status_class != proxied.status_class:
        found.append(f"status {direct.status} direct, {proxied.status} through kvproxy")
    if direct.kind != proxied.kind:
        found.append(f"body {direct.kind} direct, {proxied.kind} through kvproxy")
    elif direct.kind == "sse" and direct.events != proxied.events:
        found.append(f"events {direct.events} direct, {proxied.events} through kvproxy")
    elif direct.kind == "json":
        missing = direct.paths - proxied.paths
        extra = proxied.paths - direct.paths \
            if direct.status < 400 and not expect.get("extra") else set()
        if missing:
            found.append(f"missing through kvproxy: {sorted(missing)}")
        if extra:
            found.append(f"added by kvproxy: {sorted(extra)}")
    return found
