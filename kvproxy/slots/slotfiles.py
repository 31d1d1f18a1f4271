"""What a swap does to one slot and its files: save, restore, erase, base snapshots.

A mixin of ``SlotSwitch``: every method takes the slot it acts on, which the
caller holds (``SlotPool``). Saves go through ``disk.checked_save``; a file is
restored only when its sidecar says this llama-server made it, with the same
model, build and slot size (``-c`` split by ``-np``), and it fits the slot.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

from kvproxy.storage import disk
from kvproxy.ops import metrics
from kvproxy.sessions.identity import Session, base_stem
from kvproxy.upstream.llama import UpstreamError, UpstreamUnavailable
from kvproxy.slots.plan import too_big
from kvproxy.storage.store import now_iso

log = logging.getLogger("kvproxy.switch")

# Cache states reported to clients in X-KVProxy-Cache.
HIT, RESTORED, BASE, MISS = "hit", "restored", "base", "miss"

# A system prompt shorter than this is not worth a snapshot of its own.
MIN_BASE_TOKENS = 32


class PromptView(Protocol):
    """The request's prompt as llama-server tokenizes it (the relay provides it; asked lazily)."""

    def tokens(self) -> list[int]: ...

    def system_tokens(self, min_tokens: int = 0) -> list[int] | None: ...


class SlotFiles:
    """Save, restore and erase one slot; make base snapshots. Mixed into ``SlotSwitch``."""

    def _slot_entry(self, slot: int) -> dict | None:
        """``/slots``' entry for ``slot`` (and every slot's n_ctx noted); raises when unreachable."""
        slots = self.client.slots()
        for entry in slots:
            if isinstance(entry, dict) and isinstance(entry.get("id"), int) and entry.get("n_ctx"):
                self._n_ctx[entry["id"]] = int(entry["n_ctx"])
        return next((s for s in slots if isinstance(s, dict) and s.get("id") == slot), None)

    def save_held(self, slot: int, state: dict, made_by: dict,
                  keep: set[str] = frozenset()) -> dict | None:
        """Save the session the state table says ``slot`` holds (``state``, its entry) into
        its own file; as ``_save``. The caller holds the slot and has checked that it still
        holds that session."""
        return self._save(state["active"], state["active_stem"], made_by, kind="session",
                          system_hash=state.get("active_system_hash"), slot=slot, keep=keep,
                          tokens=int(state.get("slot_tokens") or 0))

    def _save(self, session_id: str, stem: str, made_by: dict, kind: str,
              system_hash: str | None, slot: int, tokens: int,
              keep: set[str] = frozenset()) -> dict | None:
        """Save ``slot``, holding about ``tokens``, as ``<stem>.bin``: room made first,
        written under a temporary name, checked, then renamed over the old file. A disk that
        cannot take it raises StorageError with the old file untouched; llama-server out of
        reach gives None."""
        table = self.store.read_table()
        # Files of sessions other slots hold stay too: they may be saved over, not evicted.
        protected = {stem, *keep, *(e.get("active_stem") for e in table.values())}
        estimate = self.budget.make_room(stem, tokens, made_by, protected)
        started = time.monotonic()

        def describe(answer: dict, size: int) -> dict:
            save_ms = (answer.get("timings") or {}).get("save_ms",
                                                        (time.monotonic() - started) * 1000)
            metrics.observe_swap("save", time.monotonic() - started, size)
            return self.store.merged_sidecar(
                stem, {}, session_id=session_id, kind=kind, system_hash=system_hash,
                made_by=made_by, n_tokens=answer.get("n_saved"), n_bytes=answer.get("n_written"),
                saved_bytes=size, save_ms=round(save_ms, 2), saved_at=now_iso(),
                saved_from_slot=slot, refused=None)
        try:
            sidecar = disk.checked_save(self.client, slot, self.store, stem, describe)
        except UpstreamUnavailable as exc:
            log.warning("could not save session %s: %s", session_id, exc)
            return None
        if sidecar is None:
            log.warning("not saving session %s: slot %d is empty", session_id, slot)
            return None
        if sidecar["saved_bytes"] > estimate:  # bigger than room was made for
            self.budget.trim(protected)
        if kind == "session":
            self._mark_saved(slot, stem)
        return sidecar

    def _mark_saved(self, slot: int, stem: str) -> None:
        """The session ``slot`` holds is in its file now: no unsaved turns to protect."""
        if not self.store.read_state(slot).get("unsaved"):
            return

        def saved(table: dict[int, dict]) -> None:
            entry = table.get(slot)
            if entry and entry.get("active_stem") == stem and entry.get("unsaved"):
                entry["unsaved"] = False
        self.store.change_table(saved)

    def _slot_n_ctx(self, slot: int) -> int | None:
        if slot not in self._n_ctx:
            try:
                self._slot_entry(slot)
            except (UpstreamError, UpstreamUnavailable):
                return None
        return self._n_ctx.get(slot)

    def _restorable(self, stem: str, made_by: dict, slot: int) -> dict | None:
        """The sidecar of a file that may be restored into this llama-server's ``slot``, else None."""
        if not self.store.has_bin(stem):
            return None
        sidecar = self.store.read_sidecar(stem)
        if not sidecar or not sidecar.get("saved_at"):
            log.warning("not restoring %s.bin: it has no sidecar saying what made it", stem)
            return None
        problem = disk.size_problem(self.store, stem, sidecar)
        if problem:
            log.warning("not restoring %s.bin: %s; %s, the session starts fresh",
                        stem, problem, disk.set_aside(self.store, stem, problem))
            metrics.RESTORE_MISSES.labels("bad_file").inc()
            return None
        if sidecar.get("made_by") != made_by:
            reason = f"made by {sidecar.get('made_by')}, running {made_by}"
            log.warning("not restoring %s.bin: %s", stem, reason)
            self.store.update_sidecar(stem, {}, refused=reason, refused_at=now_iso())
            metrics.RESTORE_MISSES.labels("model_mismatch").inc()
            return None
        n_ctx = self._slot_n_ctx(slot)
        problem = too_big(sidecar.get("n_tokens"), n_ctx)
        if problem:
            reason = f"{problem} of slot {slot}"
            log.warning("not restoring %s.bin: %s (llama-server would fail and wipe the slot); "
                        "the session starts fresh", stem, reason)
            self.store.update_sidecar(stem, {}, refused=reason, refused_at=now_iso())
            metrics.RESTORE_MISSES.labels("too_big").inc()
            return None
        return sidecar

    def _load(self, session: Session, made_by: dict, restoring_off: bool,
              prompt: PromptView | None, slot: int) -> tuple[str, int, str | None]:
        """Fill ``slot`` for ``session``: its own file, else a base snapshot, else empty
        (and then, for a system prompt seen first, a snapshot of that system prompt alone)."""
        if session.persistent and not restoring_off:
            candidates = [(session.stem, RESTORED)]
            if self.base_snapshots and session.system_hash:
                candidates.append((base_stem(session.system_hash), BASE))
            for stem, cache in candidates:
                if self._restorable(stem, made_by, slot):
                    restored = self._restore(stem, slot)
                    if restored is not None:
                        return cache, restored, stem
        self._erase(slot)
        held = 0
        if prompt is not None and not restoring_off and self._wants_base(session, made_by):
            held = self._make_base(session, made_by, prompt, slot)
        return MISS, held, None

    def _wants_base(self, session: Session, made_by: dict) -> bool:
        if not (self.base_snapshots and session.persistent and session.system_hash):
            return False
        stem = base_stem(session.system_hash)
        sidecar = self.store.read_sidecar(stem)
        return not (self.store.has_bin(stem) and sidecar and sidecar.get("made_by") == made_by)

    def _make_base(self, session: Session, made_by: dict, prompt: PromptView, slot: int) -> int:
        """Prefill the system prompt alone and save it as the base snapshot.

        Never the first user's message or answer: a later conversation could
        probe them through the cached-token counts every API reports. Returns
        the tokens the slot then holds (0 when no base was made).
        """
        system_hash = session.system_hash
        try:
            tokens = prompt.system_tokens(MIN_BASE_TOKENS)
            if not tokens or len(tokens) < MIN_BASE_TOKENS:
                return 0
            timings = self.client.prefill(tokens, slot).get("timings") or {}
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("no base snapshot for system prompt %s: %s", system_hash, exc)
            self._erase(slot)
            return 0
        # Not in the answer's timings: count it here, so computed tokens add up.
        computed = int(timings.get("prompt_n") or 0)
        metrics.TOKENS.labels("computed").inc(computed)
        metrics.TOKENS.labels("reused").inc(int(timings.get("cache_n") or 0))
        if self._save(f"base:{system_hash}", base_stem(system_hash), made_by, kind="base",
                      system_hash=system_hash, slot=slot, tokens=len(tokens)):
            metrics.SWAPS.labels("base").inc()
            self.store.update_sidecar(base_stem(system_hash), {}, prefill_computed=computed)
        return len(tokens)

    def _restore(self, stem: str, slot: int) -> int | None:
        started = time.monotonic()
        try:
            answer = self.client.slot_action(slot, "restore", f"{stem}.bin")
        except UpstreamError as exc:  # a failed restore wipes the slot; erase keeps it clean
            log.warning("restore of %s.bin failed: %s", stem, exc.message)
            metrics.RESTORE_MISSES.labels("failed").inc()
            return None
        restore_ms = (answer.get("timings") or {}).get("restore_ms",
                                                       (time.monotonic() - started) * 1000)
        metrics.observe_swap("restore", time.monotonic() - started, answer.get("n_read", 0))
        self.store.update_sidecar(stem, {}, count="restores", restore_ms=round(restore_ms, 2),
                                  last_used_at=now_iso(), restored_into_slot=slot)
        return int(answer.get("n_restored") or 0)

    def _erase(self, slot: int) -> None:
        started = time.monotonic()
        self.client.slot_action(slot, "erase")
        metrics.observe_swap("erase", time.monotonic() - started, 0)


def incoming_stems(session: Session) -> set[str]:
    """Files a swap to ``session`` may restore: eviction must not delete them."""
    stems = {session.stem}
    if session.system_hash:
        stems.add(base_stem(session.system_hash))
    return stems
