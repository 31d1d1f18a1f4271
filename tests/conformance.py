"""The differential conformance check: one request, sent to llama-server and to kvproxy.

Answers are compared by form, not by value: the status class, the key paths of
a JSON body, and for streams the names of the events in order (repeated deltas
collapsed into one). Corpus entries are JSON files ``{"method", "path",
"headers", "body"}`` plus optional ``"raw"`` (a body sent as text) and
``"expect"`` hints:
  ``{"direct": false}``   only kvproxy is asked (a route llama-server lacks, or one
                          whose answer would change llama-server under kvproxy)
  ``{"status": 4}``       the status class both sides must answer
  ``{"differs": "key"}``  the answer differs as row ``key`` of ``DIFFERENCES`` says

``DIFFERENCES`` is the one list of the ways kvproxy answers differently from
llama-server on the same route; any other difference fails, and so does a row that
no longer describes what happens. docs/clients.md shows it (``markdown_table``).
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


@dataclass(frozen=True)
class Difference:
    """One deliberate difference from llama-server, as the docs show it, plus what the
    suite checks: both statuses and a text of kvproxy's answer (``statuses``,
    ``message``), or what kvproxy adds to an answer of the same form (``adds_keys``,
    ``adds_events``)."""
    route: str
    shape: str
    llama_server: str
    kvproxy: str
    reason: str
    statuses: tuple[int, int] | None = None  # llama-server's, kvproxy's
    message: str | None = None  # in kvproxy's answer, and named in the docs
    adds_keys: bool = False
    adds_events: tuple[str, ...] = ()


_NEVER_SUCCEEDS = ("It can never succeed as sent: the OpenAI and Anthropic SDKs retry a 5xx "
                   "(twice by default) and clients report a server fault; a 400 says to change "
                   "the request. llama-server's message is kept.")
_MESSAGES_API = "The Messages API requires it; llama-server's route would answer anyway"

DIFFERENCES: dict[str, Difference] = {
    "anthropic-empty-messages": Difference(
        "POST /v1/messages, /v1/messages/count_tokens", "`messages` is `[]` or not a list",
        "200: an answer to (or the count of) a prompt with no messages",
        "400 `messages: a non-empty list of messages is required`",
        "The Messages API requires at least one message; an answer to no conversation "
        "is the template's empty prompt continued, never what a client meant.",
        (200, 400), "messages: a non-empty list of messages is required"),
    "anthropic-missing-messages": Difference(
        "POST /v1/messages, /v1/messages/count_tokens", "no `messages`",
        "500 `'messages' is required`",
        "400 `messages: a non-empty list of messages is required`",
        "The client's fault, so a 4xx: an SDK does not retry it.",
        (500, 400), "messages: a non-empty list of messages is required"),
    "anthropic-image-text-only": Difference(
        "POST /v1/messages, /v1/messages/count_tokens",
        "an `image` block, in a user message or inside a `tool_result`, to a model "
        "without a vision projector (`--mmproj`)",
        "500 `image input is not supported - hint: ...`",
        "400 `llama-server: image input is not supported - hint: ...`", _NEVER_SUCCEEDS,
        (500, 400), "image input is not supported"),
    "openai-image-text-only": Difference(
        "POST /v1/chat/completions, /v1/responses (every generation route)",
        "an `image_url` part to a model without a vision projector (audio and video parts "
        "without theirs alike: `audio input is not supported`, `video input ...`)",
        "500 `image input is not supported - hint: ...`",
        "400 `llama-server: image input is not supported - hint: ...`", _NEVER_SUCCEEDS,
        (500, 400), "image input is not supported"),
    "unparsable-messages": Difference(
        "POST /v1/chat/completions (every generation route)",
        "messages or tools llama-server cannot parse (a `role` that is not a string, "
        "`tools` that is not a list)",
        "500 `Failed to parse messages: [json.exception.type_error...`, "
        "`Failed to parse tools: ...`",
        "400 `llama-server: Failed to parse messages: ...` (or `tools`)", _NEVER_SUCCEEDS,
        (500, 400), "llama-server: Failed to parse"),
    "anthropic-role": Difference(
        "POST /v1/messages", "a message `role` other than `user`, `assistant`, `system`, "
        "`developer`", "200: the role is handed to the chat template",
        "400 `messages.0.role: must be 'user', 'assistant' or 'system'`",
        _MESSAGES_API + " with a role the template may render as anything.",
        (200, 400), "role: must be 'user', 'assistant' or 'system'"),
    "anthropic-max-tokens": Difference(
        "POST /v1/messages", "`max_tokens` below 1", "200: generates without that limit",
        "400 `max_tokens: must be an integer of at least 1`",
        _MESSAGES_API + " without the limit the client asked for.",
        (200, 400), "max_tokens: must be an integer of at least 1"),
    "anthropic-stop-sequences": Difference(
        "POST /v1/messages", "`stop_sequences` that is not a list of strings",
        "200: a string is taken as one stop word",
        "400 `stop_sequences: must be a list of strings`", _MESSAGES_API + ".",
        (200, 400), "stop_sequences: must be a list of strings"),
    "anthropic-tool-choice": Difference(
        "POST /v1/messages", "`tool_choice` naming a tool that is not in `tools`",
        "200: any tool may be forced", "400 `tool_choice.name: no tool named '...'`",
        _MESSAGES_API + ", forcing a tool the client did not name.",
        (200, 400), "tool_choice.name: no tool named"),
    "anthropic-cache-creation": Difference(
        "POST /v1/messages", "a whole (not streamed) answer", "its message",
        "the same message with `usage.cache_creation_input_tokens` (0)",
        "The Anthropic API always sends it; llama-server leaves it out.", adds_keys=True),
    "anthropic-ping": Difference(
        "POST /v1/messages", "`stream: true`", "its events",
        "the same events with a `ping` after `message_start`",
        "The Anthropic API sends one; llama-server does not.", adds_events=("ping",)),
    "models-listing": Difference(
        "GET /v1/models, /models", "any", "its model list",
        "the same list with the fields Anthropic clients read (`type`, `display_name`, "
        "`created_at`, `has_more`, `first_id`, `last_id`) and the served name",
        "Anthropic clients list models through the same route.", adds_keys=True),
    "health": Difference(
        "GET /health", "any", "its health", "kvproxy's health, which includes llama-server's",
        "A load balancer asks kvproxy whether it can answer, llama-server included.",
        adds_keys=True),
    "metrics": Difference(
        "GET /metrics", "any", "its own metrics (with `--metrics`)",
        "kvproxy's metrics (`kvproxy_requests_total`, ...)",
        "What is measured is the proxy: swaps, restores, waits; "
        "llama-server's stay on its own port.",
        (200, 200), "kvproxy_requests_total"),
    "root": Difference(
        "GET /", "any", "its web UI", "200 `Ollama is running`",
        "Ollama clients probe it to find a server.", (200, 200), "Ollama is running"),
    "too-many-messages": Difference(
        "POST /v1/chat/completions, /v1/messages, /api/chat (every chat route)",
        "more than `KVPROXY_MAX_MESSAGES` messages (default 4096)",
        "200, after rendering every message's template with the slot held (minutes for "
        "tens of thousands)",
        "400 `the request has N messages; kvproxy takes at most M (KVPROXY_MAX_MESSAGES)`",
        "No real conversation has that many; one such request would hold the slot for minutes "
        "while the others wait, so it is refused before the slot is taken.",
        (200, 400), "(KVPROXY_MAX_MESSAGES)"),
    "several-answers": Difference(
        "POST /v1/chat/completions, /v1/completions, /completion, /v1/responses (every "
        "generation route)", "`n` (or `n_cmpl`) above 1",
        "with several slots, 200 and that many answers, the ones after the first computed in "
        "other idle slots; 400 when `n` is above its `-np` (so always with one slot)",
        "400 `'n' is 2: kvproxy answers one completion per request ...`",
        "llama-server copies the request's slot into another idle slot for each extra answer, "
        "over the conversation kvproxy keeps there: that conversation's next turn would be "
        "computed again from nothing, or its saved file could hold this request's text. "
        "Sending the request again gives another answer.",
        (400, 400), "kvproxy answers one completion per request"),
    "slot-actions": Difference(
        "POST /slots/<id>", "`?action=save`, `restore`, `erase`",
        "200: saves, restores or erases the slot",
        "403 `POST /slots/0: slot save, restore and erase belong to kvproxy: use "
        "/api/sessions`",
        "kvproxy's record of what each slot holds would be wrong afterwards; "
        "`/api/sessions` does it with the record kept. `GET /slots` is passed through.",
        (200, 403), "slot save, restore and erase belong to kvproxy"),
}


def markdown_table() -> str:
    """docs/clients.md's list of differences: ``python -m tests.conformance`` prints it."""
    rows = ["| route | request | llama-server answers | kvproxy answers | why |",
            "| --- | --- | --- | --- | --- |"]
    rows += [f"| {d.route} | {d.shape} | {d.llama_server} | {d.kvproxy} | {d.reason} |"
             for d in DIFFERENCES.values()]
    return "\n".join(rows) + "\n"


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

    @property
    def difference(self) -> "Difference | None":
        """The row of ``DIFFERENCES`` this request's answers differ by, if any."""
        key = self.expect.get("differs")
        return DIFFERENCES[key] if key else None

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
        differs = (data.get("expect") or {}).get("differs")
        if differs is not None and differs not in DIFFERENCES:
            raise ValueError(f"{path.name}: no row {differs!r} in DIFFERENCES")
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
    text: str = ""

    @property
    def status_class(self) -> int:
        return self.status // 100


def form_of(status: int, content_type: str, text: str) -> Form:
    if "text/event-stream" in content_type:
        return Form(status, "sse", events=stream_events(text), text=text)
    try:
        return Form(status, "json", paths=key_paths(json.loads(text)), text=text)
    except ValueError:
        return Form(status, "text", text=text)


def differences(direct: Form | None, proxied: Form, row: Difference | None = None) -> list[str]:
    """What a client would notice: another status class, another kind of body, keys or
    events missing or added. An error may carry more keys through kvproxy (OpenAI's
    ``param``), never fewer; other differences only as ``row`` says, and a row that no
    longer holds is a difference too. ``direct`` is None when only kvproxy was asked."""
    if row is not None and row.statuses is not None:
        return _as_row_says(direct, proxied, row)
    if direct is None:
        return []
    found = []
    added_events = set(row.adds_events if row else ())
    if added_events:
        if not added_events & set(proxied.events):
            found.append(f"no {sorted(added_events)} through kvproxy, as the table says")
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
        extra = proxied.paths - direct.paths if direct.status < 400 else set()
        if missing:
            found.append(f"missing through kvproxy: {sorted(missing)}")
        if row is not None and row.adds_keys:
            if not extra:
                found.append("kvproxy added no keys, as the table says it does")
        elif extra:
            found.append(f"added by kvproxy: {sorted(extra)}")
    return found


def _as_row_says(direct: Form | None, proxied: Form, row: Difference) -> list[str]:
    """Both statuses exactly as the row has them, and its text in kvproxy's answer."""
    found = []
    llama_status, kvproxy_status = row.statuses
    if direct is not None and direct.status != llama_status:
        found.append(f"llama-server answered {direct.status}, the table says {llama_status}")
    if proxied.status != kvproxy_status:
        found.append(f"kvproxy answered {proxied.status}, the table says {kvproxy_status}")
    if row.message and row.message not in proxied.text:
        found.append(f"kvproxy's answer lacks {row.message!r}: {proxied.text[:200]!r}")
    return found


if __name__ == "__main__":
    print(markdown_table(), end="")
