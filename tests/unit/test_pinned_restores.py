"""Every file a swap may restore is kept from eviction from when the swap chooses it until it
is restored (issue 37): the conversation's own file, the one it was forked from (its seed), its
system prompt's base snapshot, and the stored conversation holding the longest start of its
prompt, which the swap finds only while it gathers its facts. Behind a router, each model's
disk budget keeps what another model's swap pinned."""
from __future__ import annotations

import pytest

from kvproxy.sessions.identity import Session, base_stem
from kvproxy.slots.models import ModelSwitches
from kvproxy.slots.plan import (BASE, EMPTY, RESTORED, FileFacts, SwapFacts, incoming_stems,
                                restorable_stems)
from kvproxy.slots.state import SlotState
from kvproxy.slots.switch import SlotSwitch
from kvproxy.storage.chunks.index import Prefix
from kvproxy.upstream.llama import LlamaClient
from tests.fake_llama import MODEL, UPSTREAM, FakePrompt, make_switch

PROMPT = FakePrompt(list(range(60)))


def stored(switch: SlotSwitch, fake, session_id: str, stem: str, tokens: int = 50,
           kind: str = "session", system_hash: str | None = None) -> str:
    """``stem``'s file and sidecar, saved from slot 0 as the switch saves a session."""
    fake.held[0] = tokens
    assert switch.executor.save(session_id, stem, switch.current_made_by(), kind, system_hash,
                                0, tokens) is not None
    fake.held[0] = 0
    return stem


def on_model(session: Session) -> Session:
    return session.on_model(MODEL)


def found_at(switch: SlotSwitch, monkeypatch, stem: str) -> None:
    """The stored start of the prompt is ``stem``'s (the whole-file store keeps no index of
    them: ``ChunkedFiles`` finds it by its chunks)."""
    monkeypatch.setattr(switch.files, "longest_prefix",
                        lambda tokens, accept: Prefix(stem, 50) if accept(stem) else None)


def another_save_just_before_the_restore(switch: SlotSwitch, monkeypatch) -> None:
    """Right before llama-server is asked to restore, another slot's save makes room for a file
    that needs every byte of the folder: it evicts whatever is not kept."""
    staged = switch.files.staged

    def evicting_first(stem: str):
        switch.budget.max_bytes = 1
        switch.files.make_room(f"other@{MODEL}", 10_000, switch.current_made_by(), set())
        return staged(stem)
    monkeypatch.setattr(switch.files, "staged", evicting_first)


def test_the_files_a_swap_keeps_are_those_it_knows_at_once_and_the_start_it_found():
    session = Session("B", "test", seed="S", system_hash="sysB", model=MODEL)
    assert incoming_stems(session) == {session.stem, session.seed_stem, base_stem("sysB", MODEL)}
    facts = SwapFacts(0, SlotState(), session, EMPTY, {})
    assert restorable_stems(facts) == incoming_stems(session)
    start = FileFacts(f"P@{MODEL}", True)
    assert restorable_stems(SwapFacts(0, SlotState(), session, EMPTY, {}, prefix=start)) == \
        incoming_stems(session) | {start.stem}


@pytest.mark.parametrize("kind", ["own", "seed", "base", "prefix"])
def test_a_file_the_swap_chose_is_not_evicted_before_it_is_restored(tmp_path, fake, monkeypatch,
                                                                    kind):
    switch = make_switch(tmp_path, base_snapshots=True, min_free_bytes=0)
    session = {"own": Session("B", "test"), "seed": Session("B", "test", seed="S"),
               "base": Session("B", "test", system_hash="sysB"),
               "prefix": Session("B", "test")}[kind]
    if kind == "own":
        stem = stored(switch, fake, "B", on_model(session).stem)
    elif kind == "seed":
        stem = stored(switch, fake, "S", on_model(session).seed_stem)
    elif kind == "base":
        stem = stored(switch, fake, "base:sysB", base_stem("sysB", MODEL), kind="base",
                      system_hash="sysB")
    else:
        stem = stored(switch, fake, "P", on_model(Session("P", "test")).stem)
        found_at(switch, monkeypatch, stem)
    another_save_just_before_the_restore(switch, monkeypatch)
    lease = switch.acquire(session, prompt=PROMPT)
    assert (lease.cache, lease.restored_stem) == (BASE if kind == "base" else RESTORED, stem)
    assert switch.store.bin_path(stem).is_file() and switch.budget._pins == {}
    switch.release(lease, {})


def test_the_stored_start_of_the_prompt_is_not_evicted_by_the_swaps_own_save(tmp_path, fake,
                                                                               monkeypatch):
    """The slot holds turns of A its file lacks: the swap saves A before it restores the start
    it found for B, and that save's room is never made by evicting it."""
    switch = make_switch(tmp_path, min_free_bytes=0)
    start = stored(switch, fake, "P", on_model(Session("P", "test")).stem)   # the oldest file
    lease = switch.acquire(Session("A", "test"))
    fake.held[0] = 40
    switch.release(lease, {"cache_n": 0, "prompt_n": 39, "predicted_n": 1})
    switch.budget.max_bytes = 60   # A's save fits only by evicting every other file
    found_at(switch, monkeypatch, start)
    lease = switch.acquire(Session("B", "test"), prompt=PROMPT)
    assert ("save", f"{on_model(Session('A', 'test')).stem}.saving.bin") in fake.actions
    assert (lease.cache, lease.restored_stem) == (RESTORED, start)
    switch.release(lease, {})


def test_behind_a_router_no_models_budget_evicts_a_file_another_models_swap_pinned(tmp_path,
                                                                                 fake):
    default = make_switch(tmp_path, min_free_bytes=0)
    models = ModelSwitches(LlamaClient(UPSTREAM), default,
                           lambda client, store: SlotSwitch(client, store, base_snapshots=False,
                                                            save_behind=False, min_free_bytes=0))
    other = models.switch_for("m2")
    stem = stored(default, fake, "P", on_model(Session("P", "test")).stem)
    other.budget.max_bytes = 1
    with default.files.pinned({stem}):   # a swap of the default model is about to restore it
        other.files.make_room("x@m2", 10_000, None, set())
    assert default.store.bin_path(stem).is_file()
