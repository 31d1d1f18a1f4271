"""Every URL kvproxy answers, declared once: path, methods, family, view, and its facts.

The blueprints add their rules from ``ROUTES`` (``add_rules``) and the app registers the
blueprints ``BLUEPRINTS`` names; the one check before every request (``kvproxy.web.gate``)
asks each route who may call it (``auth_for``: open, a user's key, the admin token, or
either) and whether it reads the records replies leave (``reads_records``); the request
log keeps polled routes quiet (``quiet``); errors answer in the shape of the family a
request belongs to (``error_shape``), and ``docs/routes.md`` is this table
(``markdown_table``; a test keeps it in step). Like llama-swap's ``setupGinEngine``, one
list says what the proxy serves, who answers it and who may ask.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

# Error shapes: the wire format an error is rendered in.
OPENAI, ANTHROPIC, OLLAMA, ADMIN = "OpenAI", "Anthropic", "Ollama", "admin API"

# Passthrough kinds (kvproxy.web.passthrough): how a llama-server route is relayed.
PLAIN, SIDE, REFUSED = "passthrough.plain", "passthrough.side", "passthrough.refused"

# Who may call a route (kvproxy.web.gate): anyone; with client API keys set, a user's key;
# with the admin token set, that token; or either (the key's user then sees their own only).
OPEN, KEY, TOKEN, TOKEN_OR_KEY = "open", "key", "admin", "admin or key"


@dataclass(frozen=True)
class Family:
    name: str
    errors: str  # the shape its errors answer in
    about: str
    auth: str  # who may call its routes, unless a route says otherwise
    reads_records: bool = False  # its routes wait for the replies sent to be recorded


FAMILIES = {family.name: family for family in (
    Family("openai", OPENAI, "OpenAI API (`kvproxy.web.openai`)", KEY),
    Family("anthropic", ANTHROPIC, "Anthropic Messages API (`kvproxy.web.anthropic`)", KEY),
    Family("ollama", OLLAMA, "Ollama API (`kvproxy.web.ollama`)", KEY),
    Family("llama-server", OPENAI,
           "llama-server's own generation routes, with sessions (`kvproxy.web.llamacpp`)", KEY),
    Family("passthrough", OPENAI,
           "llama-server routes relayed as they are (`kvproxy.web.passthrough`); "
           "llama-server's own errors come back unchanged", KEY),
    Family("admin", ADMIN, "session admin API (flask-smorest, `kvproxy.ops.admin`)", TOKEN,
           reads_records=True),
    Family("ops", OLLAMA, "health, metrics and the status page (`kvproxy.ops`); errors as "
                          "Ollama's, which owns `/`", OPEN),
)}

# The blueprint of each endpoint prefix, as ``module:attribute``, in the order the app
# registers them (Flask and flask-smorest add "static" and "api-docs" themselves).
BLUEPRINTS: Mapping[str, str] = {
    "ops": "kvproxy.ops.health:blueprint",
    "openai": "kvproxy.web.openai:blueprint",
    "ollama": "kvproxy.web.ollama:blueprint",
    "anthropic": "kvproxy.web.anthropic:blueprint",
    "llamacpp": "kvproxy.web.llamacpp:blueprint",
    "passthrough": "kvproxy.web.passthrough:blueprint",
    "status_page": "kvproxy.ops.status:page_blueprint",
    "sessions": "kvproxy.ops.admin:blueprint",
    "slots": "kvproxy.ops.admin:slots_blueprint",
    "status": "kvproxy.ops.status:api_blueprint",
    "store": "kvproxy.ops.store_admin:blueprint",
}


@dataclass(frozen=True)
class Route:
    path: str
    methods: tuple[str, ...]
    family: str
    endpoint: str  # "<blueprint>.<view>"
    auth: str = ""  # who may call it (OPEN, KEY, TOKEN, TOKEN_OR_KEY); "": its family's
    token: tuple[str, ...] = ()  # methods that need the admin token instead
    note: str = ""
    defaults: Mapping[str, Any] | None = field(default=None, hash=False)
    added_by: str = ""  # Flask or flask-smorest adds the rule itself
    quiet: bool = False  # polled (monitors, the status page): its request lines at DEBUG
    reads_records: bool | None = None  # waits for the replies sent; None: as its family
    # Methods after which llama-server's fingerprint must be asked again (adapters changed).
    changes_fingerprint: tuple[str, ...] = ()

    def auth_for(self, method: str) -> str:
        """Who may call this route with ``method``."""
        if method in self.token:
            return TOKEN
        return self.auth or FAMILIES[self.family].auth

    @property
    def waits_for_records(self) -> bool:
        """Reads what replies leave behind (sessions, slots, counts): the replies already
        sent are recorded before it answers."""
        return FAMILIES[self.family].reads_records if self.reads_records is None \
            else self.reads_records


def _group(paths: tuple[str, ...], methods: tuple[str, ...], family: str, endpoint: str,
           **options: Any) -> list[Route]:
    """One row per path for aliases that share everything else."""
    return [Route(path, methods, family, endpoint, **options) for path in paths]


GET, POST = ("GET",), ("POST",)

ROUTES: tuple[Route, ...] = tuple([
    # -- OpenAI API
    *_group(("/v1/chat/completions", "/chat/completions"), POST, "openai",
            "openai.chat_completions", note="chat completions, streamed or whole"),
    Route("/v1/completions", POST, "openai", "openai.completions",
          note="legacy text completions"),
    *_group(("/v1/models", "/models"), GET, "openai", "openai.models",
            note="the served model, for OpenAI and Anthropic clients"),
    # -- Anthropic Messages API
    *_group(("/v1/messages", "/messages"), POST, "anthropic", "anthropic.messages",
            note="a Message, whole or streamed"),
    *_group(("/v1/messages/count_tokens", "/messages/count_tokens"), POST, "anthropic",
            "anthropic.count_tokens", note="prompt tokens"),
    # -- Ollama API
    # Says nothing and is how Ollama clients find a server: answered without a key.
    Route("/", ("GET", "HEAD"), "ollama", "ollama.root", auth=OPEN,
          note="\"Ollama is running\""),
    Route("/api/version", GET, "ollama", "ollama.version"),
    Route("/api/tags", GET, "ollama", "ollama.tags", note="the one served model"),
    Route("/api/show", POST, "ollama", "ollama.show"),
    Route("/api/ps", GET, "ollama", "ollama.ps"),
    Route("/api/chat", POST, "ollama", "ollama.generation", defaults={"kind": "chat"}),
    Route("/api/generate", POST, "ollama", "ollama.generation", defaults={"kind": "generate"}),
    Route("/api/embed", POST, "ollama", "ollama.embed", defaults={"field": "input"}),
    Route("/api/embeddings", POST, "ollama", "ollama.embed", defaults={"field": "prompt"}),
    Route("/api/pull", POST, "ollama", "ollama.pull", note="succeeds: the model is there"),
    Route("/api/create", POST, "ollama", "ollama.manage", note="refused: one model",
          defaults={"action": "create", "field": None}),
    Route("/api/push", POST, "ollama", "ollama.manage", note="refused: one model",
          defaults={"action": "push", "field": "model"}),
    Route("/api/copy", POST, "ollama", "ollama.manage", note="refused: one model",
          defaults={"action": "copy", "field": "source"}),
    Route("/api/delete", ("DELETE",), "ollama", "ollama.manage", note="refused: one model",
          defaults={"action": "delete", "field": "model"}),
    Route("/api/blobs/<path:digest>", ("HEAD", "POST"), "ollama", "ollama.manage",
          note="no blob store: absent, uploads refused",
          defaults={"action": "upload blobs for", "field": None}),
    # -- llama-server's generation routes, with sessions
    *_group(("/v1/responses", "/responses"), POST, "llama-server", "llamacpp.responses",
            note="OpenAI Responses API"),
    Route("/infill", POST, "llama-server", "llamacpp.infill", note="fill-in-the-middle"),
    *_group(("/completion", "/completions"), POST, "llama-server", "llamacpp.completion",
            note="llama-server's native completion"),
    # -- llama-server's routes, relayed as they are: plain ones never touch the slot,
    #    side ones wait for it like a side request (kvproxy.web.passthrough)
    Route("/props", ("GET", "POST"), "passthrough", PLAIN, token=POST,
          note="model and server properties (Maki discovers the model here)"),
    *_group(("/tokenize", "/detokenize"), POST, "passthrough", PLAIN,
            note="the model's tokenizer"),
    Route("/apply-template", POST, "passthrough", PLAIN,
          note="the chat template, without generating"),
    *_group(("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
             "/responses/input_tokens", "/v1/responses/input_tokens"), POST, "passthrough",
            PLAIN, note="token counts of a chat or Responses request"),
    Route("/v1/chat/completions/control", POST, "passthrough", PLAIN,
          note="steers an answer that is running, so it must not wait for the slot"),
    Route("/slots", GET, "passthrough", PLAIN, auth=TOKEN,
          note="slot state, read only (slot actions are kvproxy's); it shows the last "
               "prompt's length, sampling settings and seed"),
    Route("/lora-adapters", ("GET", "POST"), "passthrough", PLAIN, token=POST,
          changes_fingerprint=POST, note="LoRA adapter scales"),
    Route("/v1/health", GET, "passthrough", PLAIN, note="llama-server's own health"),
    Route("/v1/stream", ("GET", "DELETE"), "passthrough", PLAIN,
          note="resumable streams of the web UI"),
    Route("/v1/streams/lookup", POST, "passthrough", PLAIN,
          note="resumable streams of the web UI"),
    *_group(("/embedding", "/embeddings", "/v1/embeddings"), POST, "passthrough", SIDE,
            note="embeddings (llama-server needs --embeddings)"),
    *_group(("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"), POST, "passthrough",
            SIDE, note="reranking (llama-server needs --reranking and a reranker model)"),
    *_group(("/audio/transcriptions", "/v1/audio/transcriptions"), POST, "passthrough", SIDE,
            note="speech to text (needs an audio model)"),
    Route("/v1/systemone", POST, "passthrough", SIDE, note="decision models"),
    Route("/slots/<id_slot>", POST, "passthrough", REFUSED,
          note="slot save, restore and erase belong to kvproxy: use /api/sessions"),
    # -- admin API (flask-smorest documents it at /api/openapi.json)
    Route("/api/sessions", GET, "admin", "sessions.Sessions", auth=TOKEN_OR_KEY,
          note="saved sessions and base snapshots (with a user's key: that user's)"),
    Route("/api/sessions/current", GET, "admin", "sessions.Current",
          note="the session a slot holds"),
    Route("/api/sessions/clear", POST, "admin", "sessions.Clear",
          note="save, erase, back to 'default'"),
    Route("/api/sessions/restore-check/reset", POST, "admin", "sessions.RestoreCheckReset",
          note="restoring back on"),
    Route("/api/sessions/<path:session_id>", ("DELETE",), "admin", "sessions.OneSession",
          note="delete a saved session"),
    Route("/api/slots", GET, "admin", "slots.Slots",
          note="every slot and its session"),
    Route("/api/store/sweep", POST, "admin", "store.Sweep", reads_records=False,
          note="sweep the shared store of unnamed chunks now, under its lease"),
    Route("/api/status", GET, "admin", "status.Status", quiet=True,
          note="everything the status page shows"),
    Route("/api/openapi.json", GET, "admin", "api-docs.openapi_json", added_by="flask-smorest",
          note="the admin API's OpenAPI document"),
    # -- operations
    Route("/health", GET, "ops", "ops.health", quiet=True,
          note="200 when llama-server answers"),
    Route("/metrics", GET, "ops", "ops.metrics", quiet=True, reads_records=True,
          note="Prometheus text format"),
    Route("/status", GET, "ops", "status_page.page", reads_records=True,
          note="the status page (its data, /api/status, needs the token)"),
    Route("/static/<path:filename>", GET, "ops", "static", added_by="Flask",
          note="the status page's script and style"),
])

BY_PATH = {route.path: route for route in ROUTES}


def add_rules(blueprint, views: Mapping[str, Any]) -> None:
    """Add the table's rules of ``blueprint`` (Flask's or flask-smorest's), each to the view
    of its name in ``views`` (the module's ``globals()``)."""
    for route in ROUTES:
        name, _, view = route.endpoint.partition(".")
        if name == blueprint.name and not route.added_by:
            options = {"defaults": dict(route.defaults)} if route.defaults else {}
            blueprint.add_url_rule(route.path, endpoint=view, view_func=views[view],
                                   methods=list(route.methods), **options)


def path_of(endpoint: str) -> str:
    """The path of the route an endpoint answers (the first, for aliases)."""
    return next(route.path for route in ROUTES if route.endpoint == endpoint)


def who_may_call(route: Route) -> str:
    """The auth column of docs/routes.md: the kind, and the methods that differ."""
    every = route.auth_for("*")
    others = [f"{method}: {route.auth_for(method)}" for method in route.methods
              if route.auth_for(method) != every]
    return "; ".join([every, *others]) if len(others) < len(route.methods) \
        else "; ".join(others)


def of_request(request) -> Route | None:
    """The table's route for the rule a request matched (None for a wrong path or method)."""
    return BY_PATH.get(request.url_rule.rule) if request.url_rule is not None else None


def matched(url_map, request) -> Route | None:
    """The table's route for a request: the rule it matched, or for a wrong method the rule
    its path matches with a right one."""
    if request.url_rule is not None:
        return of_request(request)
    valid = getattr(request.routing_exception, "valid_methods", None)
    if not valid:
        return None
    try:
        rule, _ = url_map.bind_to_environ(request.environ).match(method=valid[0],
                                                                 return_rule=True)
    except Exception:  # noqa: BLE001 - no rule after all: the path decides
        return None
    return BY_PATH.get(rule.rule)


def _segments(path: str) -> list[str]:
    return [part for part in path.split("/") if part]


def nearest_shape(path: str) -> str:
    """The error shape for a path no rule knows: that of the routes sharing the most leading
    segments with it (most of them, if they differ), or Ollama's, which owns ``/``."""
    parts = _segments(path)
    shared: dict[Route, int] = {}
    for route in ROUTES:
        count = 0
        for mine, theirs in zip(parts, _segments(route.path)):
            if mine != theirs:
                break
            count += 1
        shared[route] = count
    most = max(shared.values(), default=0)
    if most == 0:
        return OLLAMA
    shapes = Counter(FAMILIES[route.family].errors for route, n in shared.items() if n == most)
    return shapes.most_common(1)[0][0]


def error_shape(url_map, request) -> str:
    """The shape a request's errors answer in: its route's family's, else the nearest."""
    route = matched(url_map, request)
    return FAMILIES[route.family].errors if route else nearest_shape(request.path)


def markdown_table() -> str:
    """docs/routes.md's table of routes."""
    rows = ["| Path | Methods | Family | Errors | Who may call | Notes |",
            "| --- | --- | --- | --- | --- | --- |"]
    for route in ROUTES:
        note = route.note + (f" (added by {route.added_by})" if route.added_by else "")
        rows.append(f"| `{route.path}` | {', '.join(route.methods)} | {route.family} | "
                    f"{FAMILIES[route.family].errors} | {who_may_call(route)} | {note} |")
    return "\n".join(rows)


def families_table() -> str:
    """docs/routes.md's table of families."""
    rows = ["| Family | Errors answer in | What it is |", "| --- | --- | --- |"]
    rows += [f"| {f.name} | {f.errors} | {f.about} |" for f in FAMILIES.values()]
    return "\n".join(rows)


def document() -> str:
    """docs/routes.md, whole: ``python -m kvproxy.routes > docs/routes.md`` writes it."""
    return f"""# Routes

Every URL kvproxy answers, generated from `kvproxy/routes.py` (the one place routes are
declared) by `python -m kvproxy.routes > docs/routes.md`; `tests/unit/test_routes.py` fails
when this page and the table differ.

Each route belongs to a family. Its errors (bad requests, llama-server failures, a
busy slot, unknown methods, a bug as a 500) answer in the family's shape. A path no
route knows answers in the shape of the routes that share most of its leading
segments (`/v1/messages/batches`: Anthropic's; `/v1/nothing`: OpenAI's), and in
Ollama's when none does, since Ollama's API owns `/`.

"Who may call", checked once before every request (`kvproxy/web/gate.py`):

- open: anyone.
- key: with client API keys set (`KVPROXY_API_KEYS` or `KVPROXY_API_KEYS_FILE`), a
  user's key (`Authorization: Bearer <key>` or `x-api-key: <key>`); without keys, anyone.
- admin: with `KVPROXY_ADMIN_TOKEN` set, `Authorization: Bearer <token>`; without it,
  anyone.
- admin or key: the admin token, or a user's key, which then lists that user's
  sessions only (see [Users and keys](clients.md#users-and-keys)).

A missing or wrong key or token is a 401 in the route's error shape.

## Families

{families_table()}

## Routes

{markdown_table()}
"""


if __name__ == "__main__":
    print(document(), end="")
