"""The facts a slot decision is made on, gathered by asking llama-server and the slot folder.

What ``/slots`` shows of a slot (its view, its size), the files a swap may restore, and the
``SwapFacts`` the plan decides on. Every listing read here is remembered in ``SlotMemory``.
Reads only: nothing here changes a slot or a file.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from kvproxy.sessions.identity import Session, base_stem
from kvproxy.slots import plan
from kvproxy.slots.memory import SlotMemory
from kvproxy.slots.outcome import PromptView
from kvproxy.slots.plan import FileFacts, SwapFacts
from kvproxy.slots.state import SlotState
from kvproxy.storage.session_files import SessionFiles
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable

log = logging.getLogger("kvproxy.switch")


class SlotFacts:
    """Asks llama-server's ``/slots`` and the slot folder what a decision needs."""

    def __init__(self, client: LlamaClient, files: SessionFiles, memory: SlotMemory):
        self.client = client
        self.files = files
        self.memory = memory

    def slot_entry(self, slot: int) -> dict | None:
        """``/slots``' entry for ``slot`` (and every slot's n_ctx noted); raises when unreachable.
        A listing from another llama-server process than the last one is noted in ``restart``."""
        self.memory.note_listing(self.client.slots())
        return self.memory.entries.get(slot)

    def slot_n_ctx(self, slot: int) -> int | None:
        if slot not in self.memory.n_ctx:
            try:
                self.slot_entry(slot)
            except (UpstreamError, UpstreamUnavailable):
                return None
        return self.memory.n_ctx.get(slot)

    def view(self, state: SlotState, slot: int, trust_connection: bool = False) -> str:
        """Whether the slot holds what kvproxy's last action left in it (``OURS``), or not
        (``plan.view_without_asking`` says when ``/slots`` need not be asked)."""
        open_since = trust_connection and state.tokens > 0 and \
            self.client.still_open(self.memory.witness(slot))
        known = plan.view_without_asking(state, self.memory.uncertain(slot), open_since)
        if known is not None:
            return known
        try:
            entry = self.slot_entry(slot)
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("GET /slots failed (%s): slot %d is treated as foreign", exc, slot)
            return plan.UNKNOWN
        return plan.judge_slot(entry, state.tokens)

    def held_now(self, slot: int) -> int:
        """What ``/slots`` says the slot holds now: 0 when it cannot tell (llama-server gone:
        the next swap finds the slot empty or unknown)."""
        try:
            entry = self.slot_entry(slot)
        except (UpstreamError, UpstreamUnavailable):
            return 0
        return int(entry.get("n_prompt_tokens") or 0) if entry and "id_task" in entry else 0

    def prefix_facts(self, session: Session, prompt: PromptView, base: FileFacts | None,
                     pin: Callable[[set[str]], object]) -> FileFacts | None:
        """The stored session of ``session``'s user holding the longest start of its prompt,
        when it holds more of it than the base snapshot (``SessionFiles.longest_prefix``). It
        is pinned (``pin``) before its file is looked at: what the swap sees of it stays so
        until the swap is done."""
        try:
            found = self.files.longest_prefix(prompt.tokens,
                                              lambda stem: plan.may_seed_from(session, stem))
        except (UpstreamError, UpstreamUnavailable, KeyError, TypeError) as exc:
            log.info("could not tokenize the prompt to look for a stored start: %s", exc)
            return None
        if found is None or not plan.prefix_beats_base(found.tokens, base):
            return None
        pin({found.stem})
        log.info("session %s starts from %s, which holds the first %d tokens of its prompt",
                 session.id, found.stem, found.tokens)
        return self.file_facts(found.stem)

    def file_facts(self, stem: str, fetch: bool = False) -> FileFacts:
        """What the folder holds of ``stem``; with ``fetch``, a file it lacks is first looked
        up in the shared store (fetch on miss)."""
        fetched_ms = None
        if not self.files.has(stem):
            started = time.monotonic()
            if not (fetch and self.files.fetch(stem, self.memory.prefill)):
                return FileFacts(stem)
            fetched_ms = (time.monotonic() - started) * 1000
        sidecar, problem = self.files.check(stem)
        return FileFacts(stem, True, sidecar, problem, fetched_ms)

    def swap_facts(self, slot: int, state: SlotState, session: Session, view: str,
                   made_by: dict, restoring_off: bool, base_snapshots: bool,
                   prompt: PromptView | None, pin: Callable[[set[str]], object]) -> SwapFacts:
        """The swap's facts. A file found here beyond ``plan.incoming_stems`` (which the
        caller pinned) is pinned with ``pin`` as it is found."""
        own = self.file_facts(session.stem, fetch=True) if session.persistent else None
        # What may stand in for the conversation's own file is fetched only without it: the
        # conversation it follows or forks from first, else its system prompt's base.
        lacking = own is None or not own.on_disk
        seed = self.file_facts(session.seed_stem, fetch=lacking) \
            if session.persistent and session.seed else None
        base = self.file_facts(base_stem(session.base_hash, session.model),
                               fetch=lacking and not (seed and seed.on_disk)) \
            if session.persistent and session.base_hash and base_snapshots else None
        prefix = self.prefix_facts(session, prompt, base, pin) \
            if plan.looks_for_prefix(session, own, restoring_off, prompt is not None) else None
        facts = SwapFacts(slot, state, session, view, made_by, restoring_off, own, base,
                          None, base_snapshots, prompt is not None, seed, prefix)
        if plan.needs_slot_size(facts):
            facts = dataclasses.replace(facts, n_ctx=self.slot_n_ctx(slot))
        return facts
