"""Carries out what the plans decided for one slot; decides nothing itself.

The thin side of the switch: ``carry_out`` performs a list of actions from ``plan`` (a swap:
save, claim, restore, erase, base snapshots, record), from ``answer`` (the bookkeeping after an
answer) and from the restore probe, against llama-server and the slot folder; ``run`` performs
the steps of a decision that needs each answer before its next step (the restore probe's).
Every action names the slot it acts on, which the caller holds (``SlotPool``). Saves go
through ``SlotSaver``, restores through ``SlotRestorer``; what this process knows of each slot
beyond the state file is ``SlotMemory``, changed only here.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from kvproxy.telemetry import metrics
from kvproxy.sessions.identity import Session
from kvproxy.slots import answer, restore_probe as probe
from kvproxy.slots.facts import SlotFacts
from kvproxy.slots.memory import SlotMemory
# HeldElsewhere and Prefill are imported from here by older callers.
from kvproxy.slots.outcome import Filled, HeldElsewhere, Prefill, PromptView  # noqa: F401
from kvproxy.slots.plan import (FILLING, MISS, RESTORED, Adopt, Claim, Erase, KeepFile, MakeBase,
                                MarkUnproven, NoteKvFormat, Record, Refuse, Restore, Save,
                                WriteRecord)
from kvproxy.slots.restore_check import RestoreCheck, verify_restore
from kvproxy.slots.restoring import SlotRestorer
from kvproxy.slots.saving import SlotSaver
from kvproxy.slots.state import Phase, SlotState, SlotTable, claimed_for
from kvproxy.storage.session_files import SaveFailed, SessionFiles
from kvproxy.storage.store import SessionStore, now_iso, unlink_with_companions
from kvproxy.upstream import slot_file
from kvproxy.upstream.llama import LlamaClient

log = logging.getLogger("kvproxy.switch")


class SlotExecutor:
    """Performs slot actions against llama-server and the slot folder."""

    def __init__(self, client: LlamaClient, store: SessionStore, table: SlotTable,
                 files: SessionFiles, restore_check: RestoreCheck | None = None):
        self.client = client
        self.store = store
        self.table = table
        self.files = files
        self.restore_check = restore_check
        self.memory = SlotMemory()
        self.facts = SlotFacts(client, files, self.memory)
        self.saver = SlotSaver(client, store, table, files, self.memory, self.mark_unproven)
        self.restorer = SlotRestorer(client, store, files)

    # -- carrying out a plan -------------------------------------------------
    def carry_out(self, actions: list, made_by: dict | None = None,
                  prompt: PromptView | None = None, slot_ids: list[int] = (),
                  keep: set[str] = frozenset(),
                  beside_restore: Callable[[], None] | None = None) -> Filled:
        """Perform the actions in order. A swap's: the first Restore that succeeds ends the
        filling (the remaining Refuse, Restore, Erase and MakeBase are skipped);
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
                    self.saver.drop(action.slot, action.state.session_id, action.state.stem,
                                    "session", exc)
            elif isinstance(action, KeepFile):
                log_kept(action, "")
            elif isinstance(action, Claim):
                self.claim(action.slot, action.session, slot_ids)
            elif isinstance(action, Refuse):
                self.restorer.refuse(action)
            elif isinstance(action, Restore):
                self.memory.touch(action.slot)
                if beside_restore is not None:
                    beside_restore()
                # A refusal is remembered against a confirmed fingerprint only: planned with
                # an unconfirmed one, the server refusing may be another (restarted) one.
                done = self.restorer.restore(action.stem, action.slot,
                                             made_by if beside_restore is None else None,
                                             action.saved_at)
                if done is not None:
                    filled = Filled(action.cache, done[0], action.stem, restore_ms=done[1],
                                    saved_at=action.saved_at)
                    restored = True
            elif isinstance(action, Adopt):
                filled, restored = Filled(RESTORED, action.tokens, action.stem), True
            elif isinstance(action, Erase):
                self.memory.touch(action.slot)
                self.erase(action.slot)
                filled = Filled(MISS, 0)
            elif isinstance(action, MakeBase):
                self.memory.touch(action.slot)
                filled = self.make_base(action.slot, action.system_hash, made_by, prompt,
                                        action.model)
            elif isinstance(action, Record):
                filled = filled or Filled(MISS, 0)
                self.record(action.slot, action.session, filled.tokens)
            else:
                self.perform(action)
        return filled or Filled(MISS, 0)

    def run(self, steps: probe.Steps, client: LlamaClient | None = None) -> object:
        """Perform each step ``steps`` yields (``perform_step``, against ``client``, else the
        switch's) and send back its answer, or throw in whatever it raised: the steps judge
        it, and end as they must (the probe removes its file). What the steps return."""
        answer_, failure = None, None
        while True:
            try:
                step = steps.send(answer_) if failure is None else steps.throw(failure)
            except StopIteration as done:
                return done.value
            try:
                answer_ = self.perform_step(step, self.client if client is None else client)
                failure = None
            except BaseException as exc:  # noqa: BLE001 - thrown into the steps
                answer_, failure = None, exc

    def perform_step(self, step, client: LlamaClient) -> object:
        """One step of the restore probe: llama-server's answer, or the slot folder's."""
        if isinstance(step, probe.Tokenize):
            return client.tokenize(step.text)
        if isinstance(step, probe.PrefillTokens):
            return client.prefill(step.tokens, step.slot)
        if isinstance(step, probe.SlotCall):
            return client.slot_action(step.slot, step.action, *([step.name] if step.name else []))
        if isinstance(step, probe.Completion):
            return client.post_json("/completion", step.body)
        if isinstance(step, probe.ListSlots):
            return client.slots()
        if isinstance(step, probe.ReadKvFormat):
            return slot_file.kv_format(self.store.root / step.name)
        if isinstance(step, probe.RemoveFile):
            return unlink_with_companions(self.store.root / step.name)
        raise TypeError(f"not a step the executor knows: {step!r}")

    def perform(self, action) -> None:
        """One action of the bookkeeping after an answer or of what the restore probe left."""
        if isinstance(action, MarkUnproven):
            self.mark_unproven(action.slot)
        elif isinstance(action, WriteRecord):
            if action.answered:
                self.memory.writing(action.slot)
            self.table.put(action.slot, action.state)
            if action.answered:
                self.memory.written(action.slot, time.monotonic())
        elif isinstance(action, NoteKvFormat):
            self.memory.note_kv_format(action.kv_format)
        elif isinstance(action, answer.CountTokens):
            metrics.TOKENS.labels("reused").inc(action.reused)
            metrics.TOKENS.labels("computed").inc(action.computed)
            self.memory.prefill.note(action.computed, action.computed_ms / 1000)
        elif isinstance(action, answer.RanATask):
            self.memory.ran_a_task()
        elif isinstance(action, answer.NoteWitness):
            self.memory.note_witness(action.slot, action.witness)
        elif isinstance(action, answer.VerifyRestore):
            if verify_restore(self.restore_check, self.store, action.lease, action.cache_n,
                              action.key) == "not_honoured":
                metrics.RESTORE_MISSES.labels("not_honoured").inc()
        elif isinstance(action, answer.NoteRestore):
            self.store.update_sidecar(action.stem, {}, count="restores",
                                      of_save=action.saved_at, **action.note)
        elif isinstance(action, answer.CountHit):
            self.store.note_use(action.stem,
                                {"session_id": action.session_id, "kind": "session"},
                                count=action.counts, **action.fields)
        else:
            raise TypeError(f"not an action the executor knows: {action!r}")

    def save_decided(self, decision: Save | KeepFile, made_by: dict,
                     context: str = "") -> dict | None:
        """Carry out ``plan.save_or_keep``'s decision outside a swap (save behind,
        checkpoint, side requests): the new sidecar when a save was made."""
        if isinstance(decision, KeepFile):
            log_kept(decision, context)
            return None
        return self.save_session(decision.slot, decision.state, made_by)

    # -- a swap that fails -----------------------------------------------------
    def begin(self, slot: int, state: SlotState) -> None:
        """A swap of ``slot`` starts from ``state``: until an action changes the slot
        (``touch``), a failure leaves it as it was (``swap_failed``)."""
        self.memory.begin(slot, state)

    def touch(self, slot: int) -> None:
        """An action is about to change what ``slot`` holds."""
        self.memory.touch(slot)

    def swap_failed(self, slot: int) -> None:
        """After a failed swap: a slot no action changed keeps its record and its trust (a
        claim already written is undone); any other is unproven until its next good swap."""
        before = self.memory.untouched_before(slot)
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

    def distrust(self, slot: int) -> None:
        """Trust nothing ``slot`` holds (in this process) until its next good swap."""
        self.memory.distrust(slot)

    def mark_unproven(self, slot: int) -> None:
        """After a failed swap or a side request there: trust nothing the slot holds until
        its next good swap. Kept in memory and, when the disk allows, in the state file, so
        another process sharing the folder does not trust the slot either."""
        self.memory.distrust(slot)
        try:
            self.table.change(lambda table: table.__setitem__(
                slot, (table.get(slot) or SlotState()).to(Phase.UNPROVEN)))
        except Exception:  # noqa: BLE001 - the disk may be why the swap failed
            log.warning("could not mark slot %d as unknown in the state file", slot)

    # -- the slot actions ----------------------------------------------------
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
        self.memory.claimed(slot)
        other = self.table.change(claim)
        if other is not None:
            log.info("session %s is in slot %d already (another process put it there): "
                     "going there instead of slot %d", session.id, other, slot)
            raise HeldElsewhere()

    def record(self, slot: int, session: Session, tokens: int) -> None:
        """The swap is done: the slot holds ``session``, proven from now on. The state table
        learns it in the write after the answer (``memory.recorded``), one write fewer on the
        swap's path; until then it names the session as claimed: not trusted, which is all a
        crash in between may leave (the next swap restores the session's file again)."""
        self.memory.filled(slot, session, tokens, now_iso(), self.client.witness())

    def recorded(self, slot: int, state: SlotState) -> SlotState:
        """``state``, the table's entry for ``slot``, with the swap done there not yet written."""
        return self.memory.recorded(slot, state)

    def save_session(self, slot: int, state: SlotState, made_by: dict,
                     keep: set[str] = frozenset()) -> dict | None:
        """Save the session the record says ``slot`` holds into its own file; as ``save``.
        The caller holds the slot and the plan decided it (``plan.save_or_keep``)."""
        return self.save(state.session_id, state.stem, made_by, kind="session",
                         system_hash=state.system_hash, slot=slot, keep=keep,
                         tokens=state.tokens)

    def save(self, session_id: str, stem: str, made_by: dict, kind: str,
             system_hash: str | None, slot: int, tokens: int,
             keep: set[str] = frozenset()) -> dict | None:
        """Save ``slot`` as ``<stem>.bin`` (``SlotSaver.save``)."""
        return self.saver.save(session_id, stem, made_by, kind, system_hash, slot, tokens, keep)

    def erase(self, slot: int, autoload: bool = True) -> None:
        started = time.monotonic()
        self.client.slot_action(slot, "erase", autoload=autoload)
        metrics.observe_swap("erase", time.monotonic() - started, 0)

    def make_base(self, slot: int, system_hash: str, made_by: dict,
                  prompt: PromptView | None, model: str | None = None) -> Filled:
        """Prefill the system prompt alone and save it as the base snapshot
        (``SlotSaver.make_base``)."""
        return self.saver.make_base(slot, system_hash, made_by, prompt, model, self.erase)

def log_kept(kept: KeepFile, context: str) -> None:
    """Why a slot's session was not saved (``context``: where, when not in a swap)."""
    where = f" {context}" if context else ""
    if kept.restoring_off:
        log.info("not saving session %s%s from slot %d: restoring is off for this "
                 "llama-server, a file would not be restored", kept.state.session_id, where,
                 kept.slot)
    else:
        log.info("not saving session %s%s: slot %d is %s (kvproxy cannot prove it holds "
                 "that session); its file stays as it was", kept.state.session_id, where,
                 kept.slot, kept.view)
