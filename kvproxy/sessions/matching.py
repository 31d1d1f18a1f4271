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

Pure apart from ``TrailIndex``, which reads sidecars (bounded, cached by modification time).
No tokenizer call: characters stand for tokens at a conservative ratio.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
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
MAX_RECORDS = 1024         # the newest sidecars a request is compared with
MAX_NOTES = 256            # trails of requests whose sidecar is not written yet
NOTE_TTL_S = 3600.0        # a note whose sidecar never came (the request failed) is dropped
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


class TrailIndex:
    """The trails recorded in a slot folder's sidecars, re-read only when a file changed
    (its modification time and size), the newest ``MAX_RECORDS`` of them, and the trails of
    requests this process matched whose sidecar does not show them yet.

    Those notes matter because a sidecar is written once the reply has been sent: a client
    that sends its next request at once (a second chat behind the same opening) must find
    the first one, or it would be merged into it."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self._cache: dict[str, tuple[tuple[int, int], dict | None]] = {}
        self._notes: dict[str, tuple[float, dict]] = {}  # session id: (monotonic, record)
        self._lock = threading.Lock()

    def note(self, record: dict | None) -> None:
        """Remember the trail a request was matched to until its sidecar shows it."""
        if not record or not record.get("id"):
            return
        with self._lock:
            self._notes.pop(record["id"], None)
            self._notes[record["id"]] = (time.monotonic(), record)
            while len(self._notes) > MAX_NOTES:
                del self._notes[next(iter(self._notes))]

    def learn(self, name: str, written: tuple[int, int], sidecar: dict) -> None:
        """A sidecar this process has just written (``SessionStore.tell_sidecar_writes``):
        cached as the folder's listing will show it, so the next request does not read it
        back. A file another process writes later differs in time or size and is read."""
        record = trail_record(sidecar)
        with self._lock:
            self._cache[name] = (written, dict(record) if record is not None else None)

    def records(self, scope: str) -> list[dict]:
        """This scope's records: the sidecars', each replaced by a newer note of its session."""
        on_disk = self._on_disk(scope)
        with self._lock:
            now = time.monotonic()
            ids = {record.get("id"): record for record in on_disk}
            for session_id, (noted_at, record) in list(self._notes.items()):
                saved = ids.get(session_id)
                if now - noted_at > NOTE_TTL_S or \
                        (saved is not None and saved.get("whole") == record.get("whole")):
                    del self._notes[session_id]  # the sidecar caught up (or it never will)
                elif record.get("scope") == scope:
                    ids[session_id] = record
        return list(ids.values())

    def _on_disk(self, scope: str) -> list[dict]:
        try:
            entries = [e for e in os.scandir(self.root)
                       if e.name.endswith(".json") and not e.name.startswith(".")
                       and not e.name.startswith("base.")]
        except OSError:
            return []
        stats = []
        for entry in entries:
            try:
                st = entry.stat()
            except OSError:
                continue
            stats.append((st.st_mtime_ns, entry.name, st.st_size))
        stats.sort(reverse=True)
        found = []
        with self._lock:
            seen = set()
            for mtime, name, size in stats[:MAX_RECORDS]:
                seen.add(name)
                cached = self._cache.get(name)
                if cached is None or cached[0] != (mtime, size):
                    cached = ((mtime, size), self._read(name))
                    self._cache[name] = cached
                record = cached[1]
                if record and record.get("scope") == scope:
                    found.append(record)
            for name in [n for n in self._cache if n not in seen]:
                del self._cache[name]
        return found

    def _read(self, name: str) -> dict | None:
        try:
            with open(self.root / name, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError):
            return None
        return trail_record(data)


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
