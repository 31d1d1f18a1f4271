"""What each llama-server slot holds, as kvproxy last left it: one typed, frozen record per slot.

A slot is in one of five phases. Only ``OURS`` and ``UNSAVED`` are trusted: kvproxy
may serve the session there again, or save the slot over the session's file.

- ``EMPTY``: holds nothing kvproxy must keep (never used, erased, its session deleted);
- ``CLAIMED``: being filled for a session (a swap is running, or died half-way);
- ``OURS``: holds its session exactly as its file has it (or a session not worth a file);
- ``UNSAVED``: holds its session with turns its file lacks yet;
- ``UNPROVEN``: a swap failed or a side request ran there: trust nothing it holds.

Changes go through ``SlotState.to`` (checked against ``TRANSITIONS``, in the
spirit of llama-swap's ``swapState``). The records live in the slot folder's
state file (``storage.store``: versioned, migrated, a newer format refused);
``SlotTable`` reads and changes them there, under the table's own short lock.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping

from kvproxy.errors import InvalidTransition
from kvproxy.sessions.identity import DEFAULT_SESSION, Session
from kvproxy.storage.store import SessionStore, now_iso


class Phase(str, Enum):
    EMPTY = "empty"
    CLAIMED = "claimed"
    OURS = "ours"
    UNSAVED = "unsaved"
    UNPROVEN = "unproven"


TRUSTED = frozenset({Phase.OURS, Phase.UNSAVED})

# Which phase may follow which. Anything may become UNPROVEN (a failure) or CLAIMED (a
# swap starts, also over a claim a crashed process left behind); EMPTY only by erasing.
TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    Phase.EMPTY: frozenset({Phase.EMPTY, Phase.CLAIMED, Phase.UNPROVEN}),
    Phase.CLAIMED: frozenset({Phase.CLAIMED, Phase.OURS, Phase.UNPROVEN, Phase.EMPTY}),
    Phase.OURS: frozenset({Phase.OURS, Phase.UNSAVED, Phase.CLAIMED, Phase.UNPROVEN,
                           Phase.EMPTY}),
    Phase.UNSAVED: frozenset({Phase.UNSAVED, Phase.OURS, Phase.CLAIMED, Phase.UNPROVEN,
                              Phase.EMPTY}),
    Phase.UNPROVEN: frozenset({Phase.UNPROVEN, Phase.CLAIMED, Phase.EMPTY}),
}


@dataclass(frozen=True)
class SlotState:
    """One slot, as the state file records it."""

    phase: Phase = Phase.EMPTY
    session_id: str | None = None   # the session's id as clients name it
    key: str | None = None          # what the slot holds (``Session.key``)
    stem: str | None = None         # its file's name, without .bin
    persistent: bool = False        # worth a file: saved before the slot is reused
    system_hash: str | None = None  # its system prompt, for the base snapshot
    tokens: int = 0                 # tokens kvproxy left in the slot (checked against /slots)
    model: str | None = None        # the tag of the model its session is on (``model_tag``)
    updated_at: str | None = None   # when the slot last changed hands
    used_at: str | None = None      # its last use: least recently used is evicted first

    @property
    def trusted(self) -> bool:
        return self.phase in TRUSTED

    @property
    def holds_session(self) -> bool:
        """Whether the slot names a session (any phase but EMPTY)."""
        return self.phase is not Phase.EMPTY and self.session_id is not None

    @property
    def keeps_file(self) -> bool:
        """A persistent session: its file must never be overwritten by what it does not hold."""
        return self.persistent and self.holds_session

    def to(self, phase: Phase, **changes: Any) -> "SlotState":
        """The same slot in ``phase`` with ``changes``; raises on a transition that cannot be."""
        if phase not in TRANSITIONS[self.phase]:
            raise InvalidTransition(f"a slot cannot go from {self.phase.value} to {phase.value}")
        return dataclasses.replace(self, phase=phase, **changes)

    # -- the stored form -----------------------------------------------------
    def to_entry(self) -> dict:
        """The state file's entry (format 3 of ``storage.store``)."""
        entry = {"phase": self.phase.value, "active": self.session_id, "active_key": self.key,
                 "active_stem": self.stem, "active_persistent": self.persistent,
                 "active_system_hash": self.system_hash, "slot_tokens": self.tokens,
                 "updated_at": self.updated_at, "used_at": self.used_at}
        if self.model is not None:
            entry["model"] = self.model
        return entry

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any] | None) -> "SlotState":
        if not entry:
            return cls()
        try:
            phase = Phase(entry.get("phase"))
        except ValueError:  # no phase (hand-written entry): it names a session or nothing
            phase = Phase.OURS if entry.get("active") else Phase.EMPTY
        return cls(phase=phase, session_id=entry.get("active"), key=entry.get("active_key"),
                   stem=entry.get("active_stem"), persistent=bool(entry.get("active_persistent")),
                   system_hash=entry.get("active_system_hash"),
                   tokens=int(entry.get("slot_tokens") or 0), model=entry.get("model"),
                   updated_at=entry.get("updated_at"), used_at=entry.get("used_at"))


def claimed_for(state: SlotState, session: Session) -> SlotState:
    """``state`` being filled for ``session``: not trusted until the swap is done."""
    now = now_iso()
    return state.to(Phase.CLAIMED, session_id=session.id, key=session.key, stem=session.stem, model=session.model,
                    persistent=session.persistent, system_hash=session.system_hash, tokens=0,
                    updated_at=now, used_at=now)


def filled_with(state: SlotState, session: Session, tokens: int,
                done_at: str | None = None) -> SlotState:
    """The swap is done (now, or at ``done_at``): the slot holds ``session`` with ``tokens``,
    as its file has it."""
    now = done_at or now_iso()
    return state.to(Phase.OURS, session_id=session.id, key=session.key, stem=session.stem, model=session.model,
                    persistent=session.persistent, system_hash=session.system_hash,
                    tokens=tokens, updated_at=now, used_at=now)


def emptied(state: SlotState, unproven: bool) -> SlotState:
    """The slot's session was deleted: it holds nothing (unproven when it could not be erased)."""
    return state.to(Phase.UNPROVEN if unproven else Phase.EMPTY, session_id=DEFAULT_SESSION,
                    key=None, stem=None, persistent=False, system_hash=None, tokens=0,
                    updated_at=now_iso())


class SlotTable:
    """The state file's table, typed: ``{slot id: SlotState}``.

    A request reads its slot's record twice; parsing the file again only when it changed
    (``SessionStore.state_key``: every write renames a new file over it) saves a tenth of a
    millisecond each time. The records are frozen, so the parsed table can be handed out."""

    def __init__(self, store: SessionStore):
        self.store = store
        self._parsed: tuple[tuple, dict[int, SlotState]] | None = None

    def _current(self) -> dict[int, SlotState]:
        key = self.store.state_key()   # before the read: a write in between is read again
        parsed = self._parsed
        if key is not None and parsed is not None and parsed[0] == key:
            return parsed[1]
        table = {slot: SlotState.from_entry(entry)
                 for slot, entry in self.store.read_table().items()}
        self._parsed = (key, table) if key is not None else None
        return table

    def read(self) -> dict[int, SlotState]:
        return dict(self._current())

    def get(self, slot: int) -> SlotState:
        found = self._current().get(slot)
        return found if found is not None else SlotState.from_entry(None)

    def put(self, slot: int, state: SlotState) -> None:
        self.change(lambda table: table.__setitem__(slot, state))

    def change(self, change: Callable[[dict[int, SlotState]], Any]) -> Any:
        """Read, let ``change`` replace entries of the typed table, write; under the table's
        lock, so processes changing different slots never lose each other's entries."""
        def raw(entries: dict[int, dict]) -> Any:
            typed = {slot: SlotState.from_entry(entry) for slot, entry in entries.items()}
            before = dict(typed)
            result = change(typed)
            for slot, state in typed.items():
                if before.get(slot) != state:
                    entries[slot] = state.to_entry()
            return result
        return self.store.change_table(raw)
