"""Carries out what ``plan`` decided for one slot: save, claim, restore, erase, base snapshots, record.

The thin side of the switch: every method takes the slot it acts on, which the
caller holds (``SlotPool``), and performs I/O without deciding anything the
plan decides. Saved files go through the store (``storage.session_files``). It
also keeps what this process knows about each slot beyond the state file: which
slots a failed swap left uncertain, the slots' sizes from ``/slots``, and the connection to
llama-server that existed when each slot was last recorded (its "witness").
"""
from __future__ import annotations

import dataclasses
import functools

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from kvproxy.telemetry import metrics
from kvproxy.sessions.identity import Session, base_stem
from kvproxy.slots import instance, plan
from kvproxy.slots.plan import (BASE, FILLING, MISS, RESTORED, Action, Adopt, Claim, Erase,
                                FileFacts, KeepFile,
                                MakeBase, Record, Refuse, Restore, Save, SwapFacts)
from kvproxy.slots.state import Phase, SlotState, SlotTable, claimed_for, filled_with
from kvproxy.storage.session_files import NotAsRecorded, SaveFailed, SessionFiles
from kvproxy.storage.store import SessionStore, now_iso
from kvproxy.upstream import slot_file
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable

log = logging.getLogger("kvproxy.switch")

# A system prompt shorter than this is not worth a snapshot of its own.
MIN_BASE_TOKENS = 32


class PromptView(Protocol):
    """The request's prompt as llama-server tokenizes it (the relay provides it; asked lazily)."""

    def tokens(self) -> list[int]: ...

    def system_tokens(self, min_tokens: int = 0) -> list[int] | None: ...


class HeldElsewhere(Exception):
    """Another process put the session in another slot since the placement looked."""


@dataclass(frozen=True)
class Prefill:
    """A base snapshot's system prompt, computed into the slot by the swap of the request that
    needed it (llama-server's figures for that prefill). The request then finds those tokens
    in the slot, but they were computed for it: its usage reports them as computed."""

    computed: int      # tokens the prefill computed (its prompt_n)
    reused: int = 0    # tokens it found cached already (its cache_n)
    ms: float = 0.0    # its prompt_ms

    def moved(self, cache_n: int) -> int:
        """Of the ``cache_n`` tokens a request reused, those this prefill computed."""
        return max(0, min(cache_n, self.computed + self.reused) - self.reused)

    def timings(self, timings: dict) -> dict:
        """llama-server's ``timings`` of the request, with the tokens this prefill computed
        counted as computed (not reused) and its time added to the prompt's."""
        cache_n = int(timings.get("cache_n") or 0)
        moved = self.moved(cache_n)
        if not moved:
            return timings
        prompt_n = int(timings.get("prompt_n") or 0) + moved
        out = {**timings, "cache_n": cache_n - moved, "prompt_n": prompt_n}
        if "prompt_ms" in timings:
            ms = float(timings.get("prompt_ms") or 0) + self.ms
            out["prompt_ms"] = ms
            if "prompt_per_token_ms" in timings:
                out["prompt_per_token_ms"] = ms / prompt_n
            if "prompt_per_second" in timings:
                out["prompt_per_second"] = 1000.0 * prompt_n / ms if ms > 0 else 0.0
        return out


@dataclass(frozen=True)
class Filled:
    """What a swap's filling did: the cache state, the tokens the slot holds, the file used,
    the base prefill it computed."""

    cache: str
    tokens: int
    stem: str | None = None
    prefill: Prefill | None = None
    restore_ms: float | None = None   # llama-server's time for the restore, when one was made
    saved_at: str | None = None       # the save restored, as its sidecar said


class SlotExecutor:
    """Performs slot actions against llama-server and the slot folder."""

    def __init__(self, client: LlamaClient, store: SessionStore, table: SlotTable,
                 files: SessionFiles):
        self.client = client
        self.store = store
        self.table = table
        self.files = files
        self.uncertain: set[int] = set()       # a swap failed half-way: trust nothing there
        self.untouched: dict[int, SlotState] = {}  # per slot: a running swap changed nothing yet
        self.n_ctx: dict[int, int] = {}        # per slot, from /slots
        self.witness: dict[int, Any] = {}      # per slot, see view()
        self.kv_format: str | None = None      # what the last file read was written with
        self.listed: instance.Listing | None = None  # the last /slots listing's facts
        self.listed_at = float("-inf")          # when it was read (time.monotonic())
        self.restart: str | None = None        # a restart a listing showed, not yet acted on
        self.entries: dict[int, dict] = {}     # the last listing's entries, by slot
        # per slot: a swap done whose record the table learns with the request's own
        # bookkeeping (``recorded``); until then the table names the session as claimed
        self.unrecorded: dict[int, tuple[Session, int, str]] = {}

    # -- facts ---------------------------------------------------------------
    def slot_entry(self, slot: int) -> dict | None:
        """``/slots``' entry for ``slot`` (and every slot's n_ctx noted); raises when unreachable.
        A listing from another llama-server process than the last one is noted in ``restart``."""
        slots = self.client.slots()
        listed = instance.of_listing(slots)
        self.restart = instance.restarted(self.listed, listed) or self.restart
        self.listed, self.listed_at = listed or self.listed, time.monotonic()
        self.entries = {e["id"]: e for e in slots
                        if isinstance(e, dict) and isinstance(e.get("id"), int)}
        if listed is not None:
            self.n_ctx = {id_: int(e["n_ctx"]) for id_, e in self.entries.items() if e.get("n_ctx")}
        return self.entries.get(slot)

    def ran_a_task(self) -> None:
        """llama-server answered a task of kvproxy's: its task ids have started, so a listing
        that shows none comes from a process started since (``instance.restarted``)."""
        if self.listed is not None and self.listed.last_task < 0:
            self.listed = dataclasses.replace(self.listed, last_task=0)

    def forget_instance(self) -> str | None:
        """llama-server restarted: what was learned of the old process (KV format, open
        connections) no longer holds; the slot sizes are the listing's that showed the
        restart. Returns the restart's reason, and forgets it."""
        reason, self.restart = self.restart, None
        self.witness, self.kv_format = {}, None
        return reason

    def slot_n_ctx(self, slot: int) -> int | None:
        if slot not in self.n_ctx:
            try:
                self.slot_entry(slot)
            except (UpstreamError, UpstreamUnavailable):
                return None
        return self.n_ctx.get(slot)

    def view(self, state: SlotState, slot: int, trust_connection: bool = False) -> str:
        """Whether the slot holds what kvproxy's last action left in it (``OURS``), or not
        (``plan.view_without_asking`` says when ``/slots`` need not be asked)."""
        open_since = trust_connection and state.tokens > 0 and \
            self.client.still_open(self.witness.get(slot))
        known = plan.view_without_asking(state, slot in self.uncertain, open_since)
        if known is not None:
            return known
        try:
            entry = self.slot_entry(slot)
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("GET /slots failed (%s): slot %d is treated as foreign", exc, slot)
            return plan.UNKNOWN
        return plan.judge_slot(entry, state.tokens)

    def file_facts(self, stem: str) -> FileFacts:
        if not self.files.has(stem):
            return FileFacts(stem)
        sidecar, problem = self.files.check(stem)
        return FileFacts(stem, True, sidecar, problem)

    def swap_facts(self, slot: int, state: SlotState, session: Session, view: str,
                   made_by: dict, restoring_off: bool, base_snapshots: bool,
                   has_prompt: bool) -> SwapFacts:
        own = self.file_facts(session.stem) if session.persistent else None
        base = self.file_facts(base_stem(session.base_hash, session.model)) \
            if session.persistent and session.base_hash and base_snapshots else None
        seed = self.file_facts(session.seed_stem) \
            if session.persistent and session.seed else None
        facts = SwapFacts(slot, state, session, view, made_by, restoring_off, own, base,
                          None, base_snapshots, has_prompt, seed)
        if plan.needs_slot_size(facts):
            facts = dataclasses.replace(facts, n_ctx=self.slot_n_ctx(slot))
        return facts

    # -- carrying out a plan -------------------------------------------------
    def carry_out(self, actions: list[Action], made_by: dict, prompt: PromptView | None,
                  slot_ids: list[int], keep: set[str],
                  beside_restore: Callable[[], None] | None = None) -> Filled:
        """Perform a swap's actions in order; the first Restore that succeeds ends the
        filling (the remaining Refuse, Restore, Erase and MakeBase are skipped).
        ``beside_restore`` starts work that can run while llama-server restores."""
        filled: Filled | None = None
        restored = False
        for action in actions:
            if restored and isinstance(action, FILLING):
                continue
            if isinstance(action, Save):
                metrics.SLOT_SWAPS.labels(str(action.slot), "save").inc()
                try:
                    self.save_session(action.slot, action.state, made_by, keep=keep)
                except SaveFailed as exc:
                    self.drop_save(action.slot, action.state.session_id, action.state.stem,
                                   "session", exc)
            elif isinstance(action, KeepFile) and action.restoring_off:
                log.info("not saving session %s from slot %d: restoring is off for this "
                         "llama-server, a file would not be restored", action.state.session_id,
                         action.slot)
            elif isinstance(action, KeepFile):
                log.info("not saving session %s: slot %d is %s (kvproxy cannot prove it holds "
                         "that session); its file stays as it was", action.state.session_id,
                         action.slot, action.view)
            elif isinstance(action, Claim):
                self.claim(action.slot, action.session, slot_ids)
            elif isinstance(action, Refuse):
                self.refuse(action)
            elif isinstance(action, Restore):
                self.touch(action.slot)
                if beside_restore is not None:
                    beside_restore()
                # A refusal is remembered against a confirmed fingerprint only: planned with
                # an unconfirmed one, the server refusing may be another (restarted) one.
                done = self.restore(action.stem, action.slot,
                                    made_by if beside_restore is None else None, action.saved_at)
                if done is not None:
                    filled = Filled(action.cache, done[0], action.stem, restore_ms=done[1],
                                    saved_at=action.saved_at)
                    restored = True
            elif isinstance(action, Adopt):
                filled, restored = Filled(RESTORED, action.tokens, action.stem), True
            elif isinstance(action, Erase):
                self.touch(action.slot)
                self.erase(action.slot)
                filled = Filled(MISS, 0)
            elif isinstance(action, MakeBase):
                self.touch(action.slot)
                filled = self.make_base(action.slot, action.system_hash, made_by, prompt,
                                        action.model)
            elif isinstance(action, Record):
                filled = filled or Filled(MISS, 0)
                self.record(action.slot, action.session, filled.tokens)
        return filled or Filled(MISS, 0)

    def drop_save(self, slot: int, session_id: str, stem: str, kind: str,
                  failure: SaveFailed) -> None:
        """The slot folder could not take a save: the session's newest turns are not kept on
        disk, and the swap goes ahead. Its file, when it has one, still holds an older state
        that matches its sidecar (``checked_save`` keeps the old pair or removes both)."""
        kept = self.store.read_sidecar(stem) if self.store.has_bin(stem) else None
        older = f"its file keeps the state saved at {kept.get('saved_at')}" \
            if kept and kept.get("saved_at") else "it has no file"
        log.warning("dropped the save of %s %s from slot %d: %s; %s", kind, session_id, slot,
                    failure, older)
        metrics.SAVES_DROPPED.labels(kind).inc()
        self.files.dropped.note(stem, session_id, str(failure))

    # -- a swap that fails -----------------------------------------------------
    def begin(self, slot: int, state: SlotState) -> None:
        """A swap of ``slot`` starts from ``state``: until an action changes the slot
        (``touch``), a failure leaves it as it was (``swap_failed``)."""
        self.untouched[slot] = state

    def touch(self, slot: int) -> None:
        """An action is about to change what ``slot`` holds."""
        self.untouched.pop(slot, None)

    def swap_failed(self, slot: int) -> None:
        """After a failed swap: a slot no action changed keeps its record and its trust (a
        claim already written is undone); any other is unproven until its next good swap."""
        before = self.untouched.pop(slot, None)
        if before is None:
            self.mark_unproven(slot)
            return
        try:
            if self.table.get(slot) != before:
                self.table.change(lambda table: table.__setitem__(slot, before))
        except Exception:  # noqa: BLE001 - the claim stays: the slot is not trusted
            log.warning("could not undo the claim of slot %d in the state file", slot)
            self.mark_unproven(slot)
            return
        log.info("slot %d was not changed by the failed swap: it still holds %s", slot,
                 before.session_id or "nothing")

    def claim(self, slot: int, session: Session, slot_ids: list[int]) -> None:
        """Name ``session`` as what ``slot`` is being filled with, unproven until the swap is
        done. Checked and written in one step of the table, so two processes never put one
        session in two slots; raises ``HeldElsewhere`` when another slot holds it already."""
        def claim(table: dict[int, SlotState]) -> int | None:
            if session.persistent:
                for other, state in table.items():
                    if other != slot and other in slot_ids and state.session_id \
                            and state.key == session.key:
                        return other
            table[slot] = claimed_for(table.get(slot) or SlotState(), session)
            return None
        self.unrecorded.pop(slot, None)
        other = self.table.change(claim)
        if other is not None:
            log.info("session %s is in slot %d already (another process put it there): "
                     "going there instead of slot %d", session.id, other, slot)
            raise HeldElsewhere()

    def record(self, slot: int, session: Session, tokens: int) -> None:
        """The swap is done: the slot holds ``session``, proven from now on. The state table
        learns it in the write after the answer (``recorded``), one write fewer on the swap's
        path; until then it names the session as claimed: not trusted, which is all a crash
        in between may leave (the next swap restores the session's file again)."""
        self.unrecorded[slot] = (session, tokens, now_iso())
        self.uncertain.discard(slot)
        self.witness[slot] = self.client.witness()

    def recorded(self, slot: int, state: SlotState) -> SlotState:
        """``state``, the table's entry for ``slot``, with the swap done there that the table
        has not learnt yet (the holder of the slot writes it)."""
        done = self.unrecorded.get(slot)
        if done is None:
            return state
        if state.phase is not Phase.CLAIMED:  # the claim was lost with the state file
            state = claimed_for(state, done[0])
        return filled_with(state, *done)

    def mark_unproven(self, slot: int) -> None:
        """After a failed swap or a side request there: trust nothing the slot holds until
        its next good swap. Kept in memory and, when the disk allows, in the state file, so
        another process sharing the folder does not trust the slot either."""
        self.uncertain.add(slot)
        self.unrecorded.pop(slot, None)
        try:
            self.table.change(lambda table: table.__setitem__(
                slot, (table.get(slot) or SlotState()).to(Phase.UNPROVEN)))
        except Exception:  # noqa: BLE001 - the disk may be why the swap failed
            log.warning("could not mark slot %d as unknown in the state file", slot)

    def refuse(self, refused: Refuse) -> None:
        stem, reason = refused.stem, refused.reason
        if refused.quarantine:
            log.warning("not restoring %s.bin: %s; %s, the session starts fresh",
                        stem, reason, self.files.set_aside(stem, reason))
        elif refused.metric == "too_big":
            log.warning("not restoring %s.bin: %s (llama-server would fail and wipe the slot); "
                        "the session starts fresh", stem, reason)
        else:
            log.warning("not restoring %s.bin: %s", stem, reason)
        if refused.record:
            self.store.update_sidecar(stem, {}, of_save=refused.saved_at, refused=reason,
                                      refused_at=now_iso())
        if refused.metric:
            metrics.RESTORE_MISSES.labels(refused.metric).inc()

    # -- the slot actions ----------------------------------------------------
    def save_session(self, slot: int, state: SlotState, made_by: dict,
                     keep: set[str] = frozenset()) -> dict | None:
        """Save the session the record says ``slot`` holds into its own file; as ``save``.
        The caller holds the slot and has checked that it still holds that session."""
        return self.save(state.session_id, state.stem, made_by, kind="session",
                         system_hash=state.system_hash, slot=slot, keep=keep,
                         tokens=state.tokens)

    def save(self, session_id: str, stem: str, made_by: dict, kind: str,
             system_hash: str | None, slot: int, tokens: int,
             keep: set[str] = frozenset()) -> dict | None:
        """Save ``slot``, holding about ``tokens``, as ``<stem>.bin``: room made first,
        written under a temporary name, checked, then renamed over the old file. A disk that
        cannot take it raises StorageError with the old file untouched; llama-server out of
        reach gives None."""
        with self.files.saving():   # one save into the folder at a time
            return self._save(session_id, stem, made_by, kind, system_hash, slot, tokens, keep)

    def _save(self, session_id: str, stem: str, made_by: dict, kind: str,
              system_hash: str | None, slot: int, tokens: int, keep: set[str]) -> dict | None:
        # Files of sessions other slots (of any model) hold stay too: they may be saved over,
        # not evicted.
        protected = {stem, *keep, *self.store.held_stems()}
        estimate = self.files.make_room(stem, tokens, made_by, protected)
        started = time.monotonic()

        def describe(answer: dict, size: int) -> dict:
            written_as = self.note_kv_format(self.files.scratch_path(stem))
            save_ms = (answer.get("timings") or {}).get("save_ms",
                                                        (time.monotonic() - started) * 1000)
            metrics.observe_swap("save", time.monotonic() - started, size)
            return self.store.merged_sidecar(
                stem, {}, session_id=session_id, kind=kind, system_hash=system_hash,
                model=plan.model_of(made_by), made_by={**made_by, plan.KV_FORMAT: written_as} if written_as else made_by,
                n_tokens=answer.get("n_saved"), n_bytes=answer.get("n_written"),
                saved_bytes=size, save_ms=round(save_ms, 2), saved_at=now_iso(),
                saved_from_slot=slot, refused=None, refused_by=None)
        try:
            write = functools.partial(self.client.slot_action, slot, "save")  # (file name)
            sidecar = self.files.save(stem, write, describe,
                                      lambda n_saved: plan.saved_as_recorded(n_saved, tokens))
        except UpstreamUnavailable as exc:
            log.warning("could not save session %s: %s", session_id, exc)
            return None
        except NotAsRecorded as exc:
            log.warning("not saving %s %s (%d tokens recorded): %s; slot %d is unproven until "
                        "its next swap", kind, session_id, tokens, exc, slot)
            metrics.SAVES_REFUSED.labels(kind).inc()
            self.mark_unproven(slot)
            return None
        if sidecar is None:
            log.warning("not saving session %s: slot %d is empty", session_id, slot)
            return None
        if sidecar["saved_bytes"] > estimate:  # bigger than room was made for
            self.files.trim(protected)
        if kind == "session":
            self._mark_saved(slot, stem)
        return sidecar

    def note_kv_format(self, path) -> str | None:
        """The KV format of a file llama-server just wrote; a change from the last one (a
        restart with other cache types) is logged and becomes the fingerprint's."""
        found = slot_file.kv_format(path)
        if found and found != self.kv_format:
            if self.kv_format:
                log.warning("llama-server now writes KV format %s (was %s): files of the old "
                            "format are no longer offered to it", found, self.kv_format)
            self.kv_format = found
        return found

    def _mark_saved(self, slot: int, stem: str) -> None:
        """The session ``slot`` holds is in its file now: no unsaved turns to protect."""
        if self.table.get(slot).phase is not Phase.UNSAVED:
            return

        def saved(table: dict[int, SlotState]) -> None:
            state = table.get(slot)
            if state and state.stem == stem and state.phase is Phase.UNSAVED:
                table[slot] = state.to(Phase.OURS)
        self.table.change(saved)

    def restore(self, stem: str, slot: int, made_by: dict | None = None,
                saved_at: str | None = None) -> tuple[int, float] | None:
        """Restore ``<stem>.bin`` into ``slot``: the tokens restored and llama-server's time for
        it (the lease records both in the sidecar after the answer), None when it failed.
        A file llama-server refuses (400: another KV format, a layer count that differs) is
        remembered in its sidecar with the server that refused it, so it is not offered to
        that server again and a refused base is made afresh (only the save ``saved_at``:
        one put in place since was not refused)."""
        started = time.monotonic()
        try:
            answer = self.client.slot_action(slot, "restore", self.files.restore_name(stem))
        except UpstreamError as exc:  # a failed restore wipes the slot; erase keeps it clean
            log.warning("restore of %s.bin failed: %s", stem, exc.message)
            metrics.RESTORE_MISSES.labels("failed").inc()
            if exc.status == 400 and made_by is not None:
                self.store.update_sidecar(stem, {}, of_save=saved_at, refused=exc.message,
                                          refused_at=now_iso(), refused_by=made_by)
            return None
        restore_ms = (answer.get("timings") or {}).get("restore_ms",
                                                       (time.monotonic() - started) * 1000)
        metrics.observe_swap("restore", time.monotonic() - started, answer.get("n_read", 0))
        return int(answer.get("n_restored") or 0), float(restore_ms)

    def erase(self, slot: int, autoload: bool = True) -> None:
        started = time.monotonic()
        self.client.slot_action(slot, "erase", autoload=autoload)
        metrics.observe_swap("erase", time.monotonic() - started, 0)

    def make_base(self, slot: int, system_hash: str, made_by: dict,
                  prompt: PromptView | None, model: str | None = None) -> Filled:
        """Prefill the system prompt alone and save it as the base snapshot.

        Never the first user's message or answer: a later conversation could
        probe them through the cached-token counts every API reports. Returns
        the tokens the slot then holds (0 when no base was made) and the prefill
        (the request reports its tokens as computed).
        """
        if prompt is None:
            return Filled(MISS, 0)
        try:
            tokens = prompt.system_tokens(MIN_BASE_TOKENS)
            if not tokens or len(tokens) < MIN_BASE_TOKENS:
                return Filled(MISS, 0)
            timings = self.client.prefill(tokens, slot).get("timings") or {}
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("no base snapshot for system prompt %s: %s", system_hash, exc)
            self.erase(slot)
            return Filled(MISS, 0)
        # Not in the answer's timings: counted here, so computed tokens add up (what the
        # request reuses of it is counted with the request).
        computed = int(timings.get("prompt_n") or 0)
        metrics.TOKENS.labels("computed").inc(computed)
        stem = base_stem(system_hash, model)
        try:
            saved = self.save(f"base:{system_hash}", stem, made_by, kind="base",
                              system_hash=system_hash, slot=slot, tokens=len(tokens))
        except SaveFailed as exc:
            self.drop_save(slot, f"base:{system_hash}", stem, "base", exc)
            saved = None
        if saved:
            metrics.SWAPS.labels(BASE).inc()
            self.store.update_sidecar(stem, {}, prefill_computed=computed)
        prefill = Prefill(computed, int(timings.get("cache_n") or 0),
                          float(timings.get("prompt_ms") or 0))
        return Filled(MISS, len(tokens), prefill=prefill)
