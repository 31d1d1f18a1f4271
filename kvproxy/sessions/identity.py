"""Which session a request belongs to, and the file name that session may use.

Pure functions: no I/O. Ids arrive in untrusted headers and bodies, so every
client id is normalised once here (``normalise_id``: printable, bounded, no
lone surrogates) before anything logs it, sends it back in a header or keys a
file by it, and lives in its own ``client:`` namespace so that no client can
name an internal session. ``file_stem`` turns any key into a name that cannot
leave the slot folder and that llama-server's filename check accepts.
"""
from __future__ import annotations

import hashlib
import json
import json
import re
import unicodedata
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

DEFAULT_SESSION = "default"
SIDE_SESSION = "side"

# Body fields that name a session, after the headers. The first group was
# added for real clients (Claude Code, OpenAI agents); the second is the
# original design's list.
CLIENT_BODY_FIELDS = ("metadata.user_id", "prompt_cache_key", "user")
DESIGN_BODY_FIELDS = ("session_id", "conversation_id", "chat_id")

_CHAT_ID = re.compile(
    r"^(?:[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"
    r"|(?:chat|conv|conversation|session)[-_:][A-Za-z0-9_.:-]{1,120})$")
# Longer ids keep their first characters and a hash of the whole id instead of the rest.
MAX_ID_CHARS = 128
_KEPT_CHARS = 64
# Unicode categories that must not reach a log line or a header as they are:
# controls, format characters, line/paragraph separators, surrogates, private use, unassigned.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# Client ids are keyed under this prefix; internal keys (default, side, conv-..., sys-...,
# base snapshots) never start with it, so no header or body value can name one of them.
CLIENT_NAMESPACE = "client:"
# With API keys, every key of a user's request is put under this prefix and the user's
# name (``user:alice/client:chat-1#...``): no user can name another user's session, and no
# client id can name a user's key (the prefix comes first, client ids after it).
USER_NAMESPACE = "user:"
# Sessions named without an id: without keys they are scoped by the client (``scoped``).
ANONYMOUS_SOURCES = ("conversation-hash", "system-hash", "infill", "side-request", "default")


@dataclass(frozen=True)
class Session:
    """A resolved session: its id, where the id came from, and how to treat it.

    ``key`` names what the slot holds. A client's own id is combined with its
    system prompt, because one id can carry several prompts: Claude Code sends
    its session id on subagent and title calls too, and a slot can only hold
    one prompt's cache. Hash-derived ids already contain the prompt.
    """

    id: str
    source: str
    persistent: bool = True
    system_hash: str | None = None
    key: str = ""
    model: str | None = None  # the model's tag (``model_tag``): a session is on one model
    owner: str | None = None  # the user of the API key it was asked with (``scoped``)
    # A new conversation forked from a saved one (``matching``): the key of that one, whose
    # file starts this session's slot (restored, never saved over).
    seed: str | None = None
    # What this request's prompt records in the session's sidecar (``matching.Trail.record``).
    trail: dict | None = dataclasses.field(default=None, compare=False, repr=False)
    # The fields the chat template renders beside the system prompt (``template_hash_of``).
    template_hash: str | None = None

    def __post_init__(self):
        if not self.key:
            object.__setattr__(self, "key", self.id)

    @property
    def stem(self) -> str:
        own = f"{owner_tag(self.owner)}." if self.owner else ""
        return on_model(own + file_stem(self.key), self.model)

    @property
    def base_hash(self) -> str | None:
        """Names the base snapshot of the session's system prompt: its hash, with the
        template fields' when the request sets any (they change the system tokens, not
        the conversation: a client that adds a tool keeps its session)."""
        if not self.system_hash or not self.template_hash:
            return self.system_hash
        return short_hash(self.system_hash, self.template_hash)

    @property
    def seed_stem(self) -> str | None:
        """The file of the conversation this one was forked from (same owner, same model)."""
        if not self.seed:
            return None
        own = f"{owner_tag(self.owner)}." if self.owner else ""
        return on_model(own + file_stem(self.seed), self.model)

    def on_model(self, model: str | None) -> "Session":
        """This conversation on ``model``: its files carry the model's tag."""
        return self if model == self.model else dataclasses.replace(self, model=model)


def text_of(content: Any) -> str:
    """Plain text of a message content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _objects(messages: Iterable[Any]) -> list[Mapping[str, Any]]:
    """The messages that are objects: anything else is the API's to refuse, not a crash here."""
    return [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []


def system_prompt(messages: Iterable[Mapping[str, Any]]) -> str:
    """The leading system and developer messages, joined in order.

    Only those before the first other message: a system message a client adds
    later in the conversation (Claude Code's environment notes) must not turn
    the conversation into a new session.
    """
    leading = []
    for message in _objects(messages):
        if message.get("role") not in ("system", "developer"):
            break
        leading.append(text_of(message.get("content")))
    return "\n".join(leading)


def first_user_message(messages: Iterable[Mapping[str, Any]]) -> str:
    for message in _objects(messages):
        if message.get("role") == "user":
            return text_of(message.get("content"))
    return ""


def short_hash(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:16]


# Body fields the chat template renders beside the system prompt (tools in the system turn,
# thinking switches): one system prompt with other values of these has other system tokens.
TEMPLATE_FIELDS = ("tools", "functions", "tool_choice", "chat_template_kwargs",
                   "reasoning_format", "think", "thinking")


def template_hash_of(body: Mapping[str, Any]) -> str | None:
    """The hash of the ``TEMPLATE_FIELDS`` a client's body sets; None when it sets none."""
    extra = {name: body[name] for name in TEMPLATE_FIELDS
             if isinstance(body, Mapping) and body.get(name) is not None}
    if not extra:
        return None
    return short_hash(json.dumps(extra, sort_keys=True, ensure_ascii=False, default=str))


def file_stem(session_id: str) -> str:
    """A file name (without extension) for a session id that stays in its folder.

    A readable ASCII prefix keeps listings of the folder legible; the hash of
    the whole id keeps distinct ids apart after that prefix was cleaned.
    """
    readable = re.sub(r"[^A-Za-z0-9_-]+", "_", session_id)[:48].strip("_-") or "session"
    return f"{readable}-{short_hash(session_id)}"


def owner_tag(user: str) -> str:
    """How a user's files start (``<tag>.<stem>``, base snapshots ``base.<tag>.<hash>``):
    readable, and apart from every other user's by a hash of the whole name."""
    readable = re.sub(r"[^A-Za-z0-9_-]+", "_", user)[:24].strip("_-") or "user"
    return f"{readable}-{short_hash('user', user)}"


def owns(user: str, stem: str) -> bool:
    """Whether the file ``stem`` (a session's or a base snapshot's) is one of ``user``'s."""
    tag = owner_tag(user) + "."
    return stem.startswith(tag) or stem.startswith("base." + tag)


OWNER_TAG = re.compile(r"[A-Za-z0-9_-]{1,24}-[0-9a-f]{16}")


def owner_tag_of(stem: str) -> str | None:
    """The owner tag a file's stem starts with (``owner_tag``: ``<tag>.<stem>``, base snapshots
    ``base.<tag>.<hash>``), None for a file of no user's (kvproxy without API keys)."""
    name = stem.partition(MODEL_SEPARATOR)[0]
    if name.startswith("base."):
        name = name[len("base."):]
    tag, dot, _ = name.partition(".")
    return tag if dot and OWNER_TAG.fullmatch(tag) else None


def base_stem(system_hash: str, model: str | None = None) -> str:
    """File name of a system prompt's base snapshot; the dot keeps it apart from sessions."""
    return on_model(f"base.{system_hash}", model)


# Between a file's stem and its model's tag: no session stem or tag contains it.
MODEL_SEPARATOR = "@"


def model_tag(model: str | None) -> str | None:
    """A model's name or path as it appears in file names: the file name without folder
    and ``.gguf``, in the characters ``file_stem`` uses. Two models sharing one slot folder
    (one after the other, or behind llama-server's router) never write each other's files."""
    if not model:
        return None
    name = re.split(r"[/\\]", str(model).rstrip("/\\"))[-1]
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name)[:64].strip("_-") or "model"


def on_model(stem: str, model: str | None) -> str:
    """``stem`` of the model tagged ``model`` (unchanged without one)."""
    return f"{stem}{MODEL_SEPARATOR}{model}" if model else stem


def normalise_id(text: str) -> str:
    """A client's id as kvproxy shows, logs and keys it: one printable line of bounded length.

    Lone surrogates, control and other invisible characters become ``\\uXXXX``
    escapes (readable, and safe in a log line, a JSON file and a header);
    an id longer than ``MAX_ID_CHARS`` keeps its start plus a hash of the
    whole, so long ids that differ only at the end stay apart.
    """
    out = []
    for char in text:
        code = ord(char)
        if unicodedata.category(char) in _ESCAPED_CATEGORIES:
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(char)
    clean = "".join(out).strip()
    if len(clean) > MAX_ID_CHARS:
        digest = hashlib.sha256(clean.encode("utf-8")).hexdigest()[:16]
        clean = f"{clean[:_KEPT_CHARS]}~{digest}"
    return clean


def header_text(value: str) -> str:
    """A header value as the client sent it: WSGI hands headers over as latin-1 text, so
    UTF-8 bytes are decoded again, and bytes that are not UTF-8 become ``\\xNN`` escapes."""
    try:
        return value.encode("latin-1").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # already decoded (test clients)
        return value


def client_key(client_id: str, system_hash: str | None = None) -> str:
    """The slot key of a client's id: in the client namespace, paired with its system prompt."""
    key = CLIENT_NAMESPACE + client_id
    return f"{key}#{system_hash}" if system_hash else key


def kind_of_key(key: str | None) -> str:
    """What kind of session a key names, for labels that must not identify a person."""
    if not key:
        return "none"
    if key.startswith(USER_NAMESPACE):
        key = key.partition("/")[2]
    key = key.split(SCOPE_MARK, 1)[0] if key.split(SCOPE_MARK, 1)[0] in (
        DEFAULT_SESSION, SIDE_SESSION) else key
    if key.startswith(CLIENT_NAMESPACE):
        return "client"
    for prefix, kind in (("conv-", "conversation"), ("sys-", "system")):
        if key.startswith(prefix):
            return kind
    return key if key in (DEFAULT_SESSION, SIDE_SESSION) else "other"


def _body_value(body: Mapping[str, Any], dotted: str) -> Any:
    value: Any = body
    for key in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _claude_code_session(user_id: Any) -> Any:
    """Claude Code 2.x sends ``metadata.user_id`` as a JSON string holding its device,
    account and ``session_id``: that session id is the conversation (the same one its
    ``X-Claude-Code-Session-Id`` header carries), so a request that lost the header on the
    way still lands in the same session. Any other value is the id as it is."""
    if not (isinstance(user_id, str) and user_id.startswith("{")):
        return user_id
    try:
        parsed = json.loads(user_id)
    except ValueError:
        return user_id
    session_id = parsed.get("session_id") if isinstance(parsed, dict) else None
    return session_id if isinstance(session_id, str) and session_id.strip() else user_id


def _usable(value: Any) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        return normalise_id(value) or None
    return None


def explicit_id(headers: Mapping[str, str], body: Mapping[str, Any],
                header_names: Iterable[str]) -> tuple[str, str] | None:
    """The id a client named, with its source, or None."""
    # One pass over the headers, the first of repeated ones kept: werkzeug's ``get`` walks
    # them all for each of the configured names.
    sent = {name.lower(): value for name, value in reversed(list(headers.items()))}
    for name in header_names:
        raw = sent.get(name.lower())
        value = _usable(header_text(raw) if isinstance(raw, str) else raw)
        if value:
            return value, f"header:{name}"
    for field in CLIENT_BODY_FIELDS + DESIGN_BODY_FIELDS:
        raw = _body_value(body, field)
        value = _usable(_claude_code_session(raw) if field == "metadata.user_id" else raw)
        if value:
            return value, f"body:{field}"
    value = _usable(body.get("id"))
    if value and _CHAT_ID.match(value):
        return value, "body:id"
    return None


def is_side_request(messages: list[Mapping[str, Any]], stream: bool, pattern: str) -> bool:
    """OpenWebUI-style background task: not streamed, one user message matching the rule."""
    if stream:
        return False
    users = [m for m in _objects(messages) if m.get("role") == "user"]
    return len(users) == 1 and re.search(pattern, text_of(users[0].get("content"))) is not None


def resolve(headers: Mapping[str, str], body: Mapping[str, Any],
            messages: list[Mapping[str, Any]], *, stream: bool,
            header_names: Iterable[str], anonymous: str = "conversation",
            side_pattern: str = r"^### Task:") -> Session:
    """Pick the session of one request.

    Order: side request, configured headers, body fields, then a hash of the
    conversation's stable start, then ``default``.
    """
    system = system_prompt(messages)
    system_hash = short_hash(system) if system else None
    if side_pattern and is_side_request(messages, stream, side_pattern):
        return Session(SIDE_SESSION, "side-request", persistent=False)
    template_hash = template_hash_of(body) if system else None
    named = explicit_id(headers, body, header_names)
    if named:
        return Session(named[0], named[1], system_hash=system_hash,
                       key=client_key(named[0], system_hash), template_hash=template_hash)
    first_user = first_user_message(messages)
    if anonymous == "conversation" and (system or first_user):
        return Session("conv-" + short_hash(system, first_user), "conversation-hash",
                       system_hash=system_hash, template_hash=template_hash)
    if system:
        return Session("sys-" + system_hash, "system-hash", system_hash=system_hash,
                       template_hash=template_hash)
    return Session(DEFAULT_SESSION, "default", persistent=False)


# Between an unnamed session's key and the hash of the client it is scoped to.
SCOPE_MARK = "~"


def scoped(session: Session, *, user: str | None = None, client: str | None = None) -> Session:
    """The session as one user (API keys) or, without keys, one client sees it.

    ``user``: every key goes under the user's name, the files start with the user's tag
    (``owner_tag``), and the system prompt's hash, which names its base snapshot, is the
    user's own: no cached-token count ever reflects another user's text, not even a shared
    system prompt's. ``client`` (what identifies a client without a key: its address and
    user agent): sessions named without an id (``ANONYMOUS_SOURCES``) are that client's
    alone, so two clients whose conversations start alike no longer share one; ids a client
    names are left as they are (anyone who sends the id shares the session), and base
    snapshots stay shared (they hold the system prompt alone).
    """
    if user:
        system_hash = (f"{owner_tag(user)}.{short_hash(user, session.system_hash)}"
                       if session.system_hash else None)
        return dataclasses.replace(session, key=f"{USER_NAMESPACE}{user}/{session.key}",
                                   system_hash=system_hash, owner=user)
    if not client or session.source not in ANONYMOUS_SOURCES:
        return session
    mine = short_hash("client", client)
    if session.source in ("conversation-hash", "system-hash"):
        prefix, _, rest = session.id.partition("-")
        name = f"{prefix}-{short_hash(mine, rest)}"
        return dataclasses.replace(session, id=name, key=name)
    return dataclasses.replace(session, key=f"{session.key}{SCOPE_MARK}{mine}")
