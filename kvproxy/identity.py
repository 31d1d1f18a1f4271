"""Which session a request belongs to, and the file name that session may use.

Pure functions: no I/O. Ids arrive in untrusted headers and bodies, so
``file_stem`` turns any id into a name that cannot leave the slot folder and
that llama-server's filename check accepts.
"""
from __future__ import annotations

import hashlib
import re
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
_MAX_ID_CHARS = 1024


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

    def __post_init__(self):
        if not self.key:
            object.__setattr__(self, "key", self.id)

    @property
    def stem(self) -> str:
        return file_stem(self.key)


def text_of(content: Any) -> str:
    """Plain text of a message content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def system_prompt(messages: Iterable[Mapping[str, Any]]) -> str:
    """The leading system and developer messages, joined in order.

    Only those before the first other message: a system message a client adds
    later in the conversation (Claude Code's environment notes) must not turn
    the conversation into a new session.
    """
    leading = []
    for message in messages:
        if message.get("role") not in ("system", "developer"):
            break
        leading.append(text_of(message.get("content")))
    return "\n".join(leading)


def first_user_message(messages: Iterable[Mapping[str, Any]]) -> str:
    for message in messages:
        if message.get("role") == "user":
            return text_of(message.get("content"))
    return ""


def short_hash(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def file_stem(session_id: str) -> str:
    """A file name (without extension) for a session id that stays in its folder.

    A readable ASCII prefix keeps listings of the folder legible; the hash of
    the whole id keeps distinct ids apart after that prefix was cleaned.
    """
    readable = re.sub(r"[^A-Za-z0-9_-]+", "_", session_id)[:48].strip("_-") or "session"
    return f"{readable}-{short_hash(session_id)}"


def base_stem(system_hash: str) -> str:
    """File name of a system prompt's base snapshot; the dot keeps it apart from sessions."""
    return f"base.{system_hash}"


def _body_value(body: Mapping[str, Any], dotted: str) -> Any:
    value: Any = body
    for key in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _usable(value: Any) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()[:_MAX_ID_CHARS]
    return None


def explicit_id(headers: Mapping[str, str], body: Mapping[str, Any],
                header_names: Iterable[str]) -> tuple[str, str] | None:
    """The id a client named, with its source, or None."""
    for name in header_names:
        value = _usable(headers.get(name))
        if value:
            return value, f"header:{name}"
    for field in CLIENT_BODY_FIELDS + DESIGN_BODY_FIELDS:
        value = _usable(_body_value(body, field))
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
    users = [m for m in messages if m.get("role") == "user"]
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
    named = explicit_id(headers, body, header_names)
    if named:
        key = f"{named[0]}#{system_hash}" if system_hash else named[0]
        return Session(named[0], named[1], system_hash=system_hash, key=key)
    first_user = first_user_message(messages)
    if anonymous == "conversation" and (system or first_user):
        return Session("conv-" + short_hash(system, first_user), "conversation-hash",
                       system_hash=system_hash)
    if system:
        return Session("sys-" + system_hash, "system-hash", system_hash=system_hash)
    return Session(DEFAULT_SESSION, "default", persistent=False)
