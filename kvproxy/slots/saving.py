"""Saving a slot into the slot folder: a session, or a base snapshot prefilled for it.

The one way a slot becomes a file: room made first, checked, then put in place, through the disk budget
(``make_room``, ``trim``) and the store's checked ``save``, which asks llama-server to
save and checks the result against what kvproxy recorded (``plan.saved_as_recorded``). The
files left alone while saving are ``plan.save_protected``'s. A save the folder cannot take is
dropped (``drop``) and the swap goes on.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Callable

from kvproxy.telemetry import metrics
from kvproxy.sessions.identity import base_stem
from kvproxy.slots import plan
from kvproxy.slots.outcome import Filled, Prefill, PromptView
from kvproxy.slots.plan import BASE, MIN_BASE_TOKENS, MISS
from kvproxy.slots.memory import SlotMemory
from kvproxy.slots.state import Phase, SlotState, SlotTable
from kvproxy.storage.session_files import NotAsRecorded, SaveFailed, SessionFiles
from kvproxy.storage.store import SessionStore, now_iso
from kvproxy.upstream import slot_file
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable

log = logging.getLogger("kvproxy.switch")


class SlotSaver:
    """Writes slots into the slot folder (the caller holds the slot)."""

    def __init__(self, client: LlamaClient, store: SessionStore, table: SlotTable,
                 files: SessionFiles, memory: SlotMemory,
                 distrust: Callable[[int], None]):
        self.client = client
        self.store = store
        self.table = table
        self.files = files
        self.memory = memory
        self.distrust = distrust  # a slot whose save caught something else: unproven

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
        protected = plan.save_protected(stem, keep, self.store.held_stems())
        estimate = self.files.make_room(stem, tokens, made_by, protected)
        started = time.monotonic()

        def describe(answer: dict, size: int) -> dict:
            written_as = slot_file.kv_format(self.files.scratch_path(stem))
            self.memory.note_kv_format(written_as)
            save_ms = (answer.get("timings") or {}).get("save_ms",
                                                        (time.monotonic() - started) * 1000)
            metrics.observe_swap("save", time.monotonic() - started, size)
            return dict(  # laid over the sidecar there as the save is put in place
                session_id=session_id, kind=kind, system_hash=system_hash,
                model=plan.model_of(made_by),
                made_by={**made_by, plan.KV_FORMAT: written_as} if written_as else made_by,
                n_tokens=answer.get("n_saved"), n_bytes=answer.get("n_written"),
                saved_bytes=size, save_ms=round(save_ms, 2), saved_at=now_iso(),
                saved_from_slot=slot, refused=None, refused_by=None, stored_as="file",
                chunks=None, written_bytes=size)
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
            self.distrust(slot)
            return None
        if sidecar is None:
            log.warning("not saving session %s: slot %d is empty", session_id, slot)
            return None
        if plan.trim_after_save(sidecar["saved_bytes"], estimate):
            self.files.trim(protected)
        if kind == "session":
            self._mark_saved(slot, stem)
        return sidecar

    def make_base(self, slot: int, system_hash: str, made_by: dict,
                  prompt: PromptView | None, model: str | None,
                  erase: Callable[[int], None]) -> Filled:
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
            if not plan.base_worth_making(tokens):
                return Filled(MISS, 0)
            timings = self.client.prefill(tokens, slot).get("timings") or {}
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("no base snapshot for system prompt %s: %s", system_hash, exc)
            erase(slot)
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
            self.drop(slot, f"base:{system_hash}", stem, "base", exc)
            saved = None
        if saved:
            metrics.SWAPS.labels(BASE).inc()
            self.store.update_sidecar(stem, {}, prefill_computed=computed)
        prefill = Prefill(computed, int(timings.get("cache_n") or 0),
                          float(timings.get("prompt_ms") or 0))
        return Filled(MISS, len(tokens), prefill=prefill)

    def _mark_saved(self, slot: int, stem: str) -> None:
        """The session ``slot`` holds is in its file now: no unsaved turns to protect."""
        if self.table.get(slot).phase is not Phase.UNSAVED:
            return

        def saved(table: dict[int, SlotState]) -> None:
            state = table.get(slot)
            if state and state.stem == stem and state.phase is Phase.UNSAVED:
                table[slot] = state.to(Phase.OURS)
        self.table.change(saved)

    def drop(self, slot: int, session_id: str, stem: str, kind: str,
             failure: SaveFailed) -> None:
        """The slot folder could not take a save: the session's newest turns are not kept on
        disk, and the swap goes ahead. Its file, when it has one, still holds an older state
        that matches its sidecar (``checked_save`` keeps the old pair or removes both)."""
        kept = self.store.read_sidecar(stem) if self.files.has(stem) else None
        older = f"its file keeps the state saved at {kept.get('saved_at')}" \
            if kept and kept.get("saved_at") else "it has no file"
        log.warning("dropped the save of %s %s from slot %d: %s; %s", kind, session_id, slot,
                    failure, older)
        metrics.SAVES_DROPPED.labels(kind).inc()
        self.files.dropped.note(stem, session_id, str(failure))
