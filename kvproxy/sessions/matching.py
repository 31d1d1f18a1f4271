"""Following a conversation that names no id by what it shares with the ones saved.

A request without an id used to be keyed on its system prompt and first user message
alone (``identity.resolve``). That splits a conversation whose client rewrites its first
message between turns (a reminder moved to the newest message) and merges every chat that
opens with the same fixed example exchange. Here each anonymous conversation records in its
sidecar a *trail*: chained hashes over fixed-size blocks of a canonical serialization of
its prompt (no text is stored), and a new request is compared with the trails of this
client's own conversations (one scope: one user, or one client address and agent):

- it **continues** the conversation whose whole recorded prompt it starts with, or most of
  it when the request is a later turn (more messages): that session's own file;
- it **forks** from one it shares a long prefix with but then leaves early: a new session,
  seeded from that conversation's file (restored, never saved over);
- else it is the conversation of its start, as before.

Pure functions, no I/O: the saved trails come from ``relay.trails.TrailIndex``, which reads
them through the store. No tokenizer call: characters stand for tokens at a conservative ratio.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from kvproxy.sessions.identity import Session, short_hash, text_of

BLOCK_CHARS = 256
# Characters counted as one token when a prefix is judged long enough: generous, so a
# prefix judged worth a restore holds at least that many tokens in any usual text.
CHARS_PER_TOKEN = 4
# A later turn whose prompt shares this share of a conversation's recorded blocks continues
# it, although the client rewrote something near the end of an early message.
MOST = 0.9
MAX_BLOCKS = 8192          # trails end there (2 MiB of text)
SIDECAR_FIELD = "trail"

CONTINUE, FORK = "continue", "fork"


def canonical(messages: Iterable[Any], tools: Any = None) -> str:
    """The prompt as one string, in order: tools, then each message's role, text and tool
    calls. Equal strings mean prompts llama-server templates alike."""
    out = []
    if tools:
        out.append("T\x1e" + json.dumps(tools, sort_keys=True, ensure_ascii=False) + "\x1f")
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, Mapping):
            continue
        calls = message.get("tool_calls")
        extra = json.dumps(calls, sort_keys=True, ensure_ascii=False) if calls else ""
        out.append(f"{message.get('role')}\x1e{text_of(message.get('content'))}{extra}\x1f")
    return "".join(out)


def _digest(data: str) -> str:
    return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def chain(text: str) -> list[str]:
    """Chained hashes of the complete blocks of ``text``: equal at ``i`` means equal up to
    the end of block ``i``."""
    hashes, last = [], ""
    for start in range(0, min(len(text), MAX_BLOCKS * BLOCK_CHARS) - BLOCK_CHARS + 1,
                       BLOCK_CHARS):
        last = _digest(last + text[start:start + BLOCK_CHARS])
        hashes.append(last)
    return hashes


@dataclass(frozen=True)
class Trail:
    """What a request's prompt is, as far as matching needs: never its text."""

    blocks: tuple[str, ...]
    chars: int
    whole: str
    messages: int
    text: str = dataclasses.field(default="", compare=False, repr=False)  # in memory only
    head: int = 0   # characters of its tools and leading system messages (the base's part)

    def record(self, session: Session, scope: str) -> dict:
        """The sidecar field of ``session``'s conversation after this request."""
        return {"scope": scope, "id": session.id, "key": session.key,
                "system_hash": session.system_hash, "blocks": list(self.blocks),
                "chars": self.chars, "whole": self.whole, "messages": self.messages}

    def starts_with(self, record: dict) -> bool:
        """Whether this prompt starts with all of the recorded one."""
        chars = record.get("chars")
        return isinstance(chars, int) and chars <= self.chars and \
            _digest(self.text[:chars]) == record.get("whole")


def trail_of(messages: Iterable[Any], tools: Any = None) -> Trail:
    text = canonical(messages, tools)
    listed = [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []
    leading = []
    for message in listed:
        if message.get("role") not in ("system", "developer"):
            break
        leading.append(message)
    head = len(canonical(leading, tools)) if leading or tools else 0
    return Trail(tuple(chain(text)), len(text), _digest(text), len(listed), text, head)


def shared_blocks(a: Iterable[str], b: Iterable[str]) -> int:
    """How many leading blocks two trails share."""
    return len(os.path.commonprefix([list(a), list(b)]))


@dataclass(frozen=True)
class Match:
    kind: str          # CONTINUE or FORK
    record: dict       # the saved conversation's trail record
    shared_chars: int


def decide(trail: Trail, records: Iterable[dict], min_chars: int) -> Match | None:
    """The saved conversation the request continues or forks from, or None.

    The record sharing the most leading blocks wins (ties: one the request starts with,
    then the smallest id), if that prefix is at least ``min_chars`` long. The request
    continues it when it starts with the whole recorded prompt, or when it is a later turn
    (more messages) sharing ``MOST`` of its blocks; else it forks from it.
    """
    best, best_rank = None, None
    for record in records:
        blocks = record.get("blocks")
        if not isinstance(blocks, list):
            continue
        shared = shared_blocks(trail.blocks, blocks)
        if shared == 0:
            continue
        extends = shared == len(blocks) and trail.starts_with(record)
        rank = (shared, extends, _neg(str(record.get("id"))))
        if best_rank is None or rank > best_rank:
            best, best_rank = record, rank
    if best is None:
        return None
    shared, extends = best_rank[0], best_rank[1]
    shared_chars = shared * BLOCK_CHARS
    if shared_chars < min_chars:
        return None
    n_blocks = len(best["blocks"])
    later = trail.messages > int(best.get("messages") or 0)
    if extends or (later and shared >= MOST * n_blocks):
        return Match(CONTINUE, best, shared_chars)
    return Match(FORK, best, shared_chars)


def _neg(text: str) -> tuple:
    """Orders strings backwards inside a ``max``: the smallest wins a tie."""
    return tuple(-ord(c) for c in text)


def scope_of(user: str | None, client: str | None) -> str:
    """The scope a conversation is matched in: its user's, else its client's."""
    return short_hash("user", user) if user else short_hash("client", client or "")


def trail_record(sidecar: Any) -> dict | None:
    """The trail a sidecar's content records, if it records one."""
    record = sidecar.get(SIDECAR_FIELD) if isinstance(sidecar, dict) else None
    return record if isinstance(record, dict) else None


def follow(session: Session, trail: Trail, records: list[dict], scope: str, min_chars: int,
           rescope) -> Session:
    """The session of an anonymous conversation request (``session``, already scoped),
    after matching its ``trail`` against this scope's ``records``. ``rescope`` scopes an
    unscoped session as ``session`` was (for a fork's new id)."""
    found = decide(trail, records, min_chars) if min_chars > 0 else None
    if found is not None and found.kind == FORK and \
            found.shared_chars <= trail.head + BLOCK_CHARS:
        # Only the system prompt in common: the base snapshot holds exactly that, and no
        # other conversation's turns are restored for a new one.
        found = None
    if found is not None and found.kind == CONTINUE:
        record = found.record
        followed = dataclasses.replace(session, id=record["id"], key=record["key"],
                                       system_hash=record.get("system_hash"))
        return dataclasses.replace(followed, trail=trail.record(followed, scope))
    # The key of its first messages is another conversation's when that one's prompt is not
    # where this one starts (a short fixed opening, under the length worth a restore) and
    # this is no later turn of it: a later turn keeps the key's session, as before matching
    # (a client that moved a part of its first message to the newest one).
    taken = any(r.get("key") == session.key and not trail.starts_with(r)
                and trail.messages <= int(r.get("messages") or 0) for r in records)
    if found is None and not taken:
        return dataclasses.replace(session, trail=trail.record(session, scope))
    # A new conversation behind a saved one's start: its own session, never that one's.
    point = trail.blocks[found.shared_chars // BLOCK_CHARS] \
        if found and found.shared_chars // BLOCK_CHARS < len(trail.blocks) else trail.whole
    forked = rescope("conv-" + short_hash("fork", session.id, point))
    seed = found.record["key"] if found else None
    forked = dataclasses.replace(forked, seed=seed)
    return dataclasses.replace(forked, trail=trail.record(forked, scope))
