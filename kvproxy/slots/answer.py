"""Pure decision: what an answer changes, as actions the executor performs.

After a request's last byte the switch gathers the facts (``AnswerFacts``: the slot's record
with its swap, what the answer's timings say the slot holds, whether the session was deleted
meanwhile); ``after_answer`` returns the bookkeeping as a list of actions (count the tokens,
record the slot, check the restore, note the restore and the hit in the sidecars, with the
conversation's trail), and ``SlotExecutor.carry_out`` performs them. No I/O here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvproxy.sessions.identity import Session
from kvproxy.slots import plan
from kvproxy.slots.plan import BASE, RESTORED, MarkUnproven, WriteRecord
from kvproxy.slots.state import Phase, SlotState


@dataclass(frozen=True)
class CountTokens:
    """The request's prompt tokens, reused and computed, for ``/metrics``; and how long the
    computing took, for this node's prefill pace (fetch or compute: ``SlotMemory.prefill``)."""
    reused: int
    computed: int
    computed_ms: float = 0.0


@dataclass(frozen=True)
class RanATask:
    """llama-server answered a task of kvproxy's (``SlotMemory.ran_a_task``)."""


@dataclass(frozen=True)
class NoteWitness:
    """Remember the connection of the answer as the slot's witness (``facts.view``)."""
    slot: int
    witness: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class VerifyRestore:
    """Compare the tokens the swap restored with those llama-server reused (restore_check)."""
    lease: Any = field(compare=False)
    cache_n: int
    key: str                       # the fingerprint of the llama-server the swap found


@dataclass(frozen=True)
class NoteRestore:
    """The restored file's sidecar counts the restore (another session's file: a seed, a base)."""
    stem: str
    saved_at: str | None
    note: dict = field(hash=False)


@dataclass(frozen=True)
class CountHit:
    """The session's sidecar counts the request (and its own restore), with its trail."""
    stem: str
    session_id: str
    counts: tuple[str, ...]
    fields: dict = field(hash=False)


AnswerAction = Any  # one of the dataclasses above, WriteRecord or MarkUnproven


@dataclass(frozen=True)
class AnswerFacts:
    """Everything the bookkeeping after an answer is decided on."""

    slot: int
    session: Session
    cache: str                     # the swap's cache state (HIT, RESTORED, ...)
    timings: dict                  # llama-server's timings ({} when the answer had none)
    figures: dict                  # the timings as the request's usage (``Lease.figures``)
    state: SlotState = SlotState() # the slot's record, with the swap not yet written
    swapped: bool = False          # a swap's record is still to be written
    deleted: bool = False          # the session was deleted while the request ran
    held: int = 0                  # tokens the slot holds now (0: unknown)
    used_at: str = ""
    several_slots: bool = False
    since_written: float = 0.0     # seconds since this process last wrote the slot's use
    restored_stem: str | None = None
    restored_saved_at: str | None = None
    restore_note: dict = field(default_factory=dict)  # ``Lease.restore_note``
    fingerprint: str = ""          # ``plan.fingerprint_key`` of the swap's llama-server
    lease: Any = field(default=None, compare=False)
    witness: Any = field(default=None, compare=False)  # ``LlamaClient.witness`` at the answer
    now: str = ""                  # the time written into the sidecar


def after_answer(facts: AnswerFacts) -> list[AnswerAction]:
    """The bookkeeping after a request, in order. A session deleted while it ran leaves
    nothing in the slot that may be served or saved (its swap may have restored the old
    file). Otherwise the slot's record is written when it changed or its swap is not yet
    written; a restore is verified against what the answer reused; the restored file and the
    session's own sidecar count the request."""
    figures, timings, session, slot = facts.figures, facts.timings, facts.session, facts.slot
    cache_n = int(figures.get("cache_n") or 0)
    actions: list[AnswerAction] = [
        CountTokens(cache_n, int(timings.get("prompt_n") or 0),
                    float(timings.get("prompt_ms") or 0))]
    if timings:
        actions.append(RanATask())
    if session.persistent and facts.deleted:
        return actions + [MarkUnproven(slot)]
    actions.append(NoteWitness(slot, facts.witness))
    new = recorded_after(facts.state, session, facts.held, facts.used_at, facts.several_slots,
                         facts.since_written)
    if new is not None or facts.swapped:
        actions.append(WriteRecord(slot, new or facts.state, answered=True))
    if facts.cache in (RESTORED, BASE) and timings:
        actions.append(VerifyRestore(facts.lease, cache_n, facts.fingerprint))
    restored = facts.restore_note
    own = bool(restored) and facts.restored_stem == session.stem
    if restored and not own:
        actions.append(NoteRestore(facts.restored_stem, facts.restored_saved_at, restored))
    if session.persistent:
        actions.append(CountHit(session.stem, session.id,
                                ("hits", "restores") if own else ("hits",),
                                hit_fields(facts, cache_n, own)))
    return actions


def hit_fields(facts: AnswerFacts, cache_n: int, own_restore: bool) -> dict:
    """What the session's sidecar learns of the request: its last use and cache figures, its
    trail, and the restore of its own file that this request's swap made."""
    session = facts.session
    fields = {"session_id": session.id, "last_used_at": facts.now, "last_cache": facts.cache,
              "last_cache_n": cache_n,
              "last_prompt_n": int(facts.figures.get("prompt_n") or 0)}
    if session.trail:
        fields["trail"] = session.trail
    if own_restore:
        fields.update({k: v for k, v in facts.restore_note.items() if k != "last_used_at"})
    return fields


def recorded_after(state: SlotState, session: Session, held: int, used_at: str,
                   several_slots: bool, since_written: float) -> SlotState | None:
    """The record after a request of ``session`` that left ``held`` tokens in the slot
    (0: unknown); None: unchanged. A persistent session now has turns its file lacks
    (``UNSAVED``); an unproven slot stays unproven. The last use orders slots for eviction,
    so it matters only with several slots: written alone at most once a second
    (``since_written``: seconds since this process last wrote it), so a no-swap request
    writes no more with several slots than with one."""
    changes: dict = {}
    if held and state.tokens != held:
        changes["tokens"] = held
    phase = state.phase
    if session.persistent and state.trusted:
        phase = Phase.UNSAVED
    if changes or phase is not state.phase:
        return state.to(phase, used_at=used_at, **changes)
    if several_slots and since_written >= plan.USED_AT_RESOLUTION_S:
        return state.to(phase, used_at=used_at)
    return None


def held_by_timings(timings: dict) -> int:
    """What the slot holds after an answer: the prompt it reused and computed plus the answer."""
    return sum(int(timings.get(k) or 0) for k in ("cache_n", "prompt_n", "predicted_n"))
