"""The typed slot state: checked transitions, its stored form, the state file's migration."""
from __future__ import annotations

import json

import pytest

from kvproxy.sessions.identity import Session
from kvproxy.errors import InvalidTransition
from kvproxy.slots.state import (TRANSITIONS, Phase, SlotState, SlotTable,
                                 claimed_for, emptied, filled_with)
from kvproxy.storage.store import STATE_FILE, SessionStore, StateFormatError, migrate_state

A = Session("A", "header", system_hash="h", key="kA")


def test_a_swap_goes_claimed_then_ours_and_turns_make_it_unsaved():
    claimed = claimed_for(SlotState(), A)
    assert (claimed.phase, claimed.key, claimed.tokens, claimed.trusted) == \
        (Phase.CLAIMED, "kA", 0, False)
    filled = filled_with(claimed, A, 30)
    assert (filled.phase, filled.tokens, filled.trusted) == (Phase.OURS, 30, True)
    assert filled.to(Phase.UNSAVED).trusted


def test_transitions_that_cannot_be_are_refused():
    with pytest.raises(InvalidTransition, match="from empty to ours"):
        SlotState().to(Phase.OURS)
    with pytest.raises(InvalidTransition, match="from unproven to unsaved"):
        SlotState(Phase.UNPROVEN).to(Phase.UNSAVED)
    for phase in Phase:
        assert Phase.UNPROVEN in TRANSITIONS[phase], f"a failure may strike in {phase.value}"
        assert Phase.CLAIMED in TRANSITIONS[phase], f"a swap may start from {phase.value}"


def test_a_deleted_session_leaves_the_slot_empty_or_unproven():
    held = filled_with(claimed_for(SlotState(), A), A, 30)
    assert emptied(held, unproven=False).phase is Phase.EMPTY
    gone = emptied(held, unproven=True)
    assert (gone.phase, gone.key, gone.persistent, gone.tokens) == (Phase.UNPROVEN, None, False, 0)


def test_the_stored_form_round_trips():
    state = SlotState(Phase.UNSAVED, "A", "kA", "stem", True, "h", 12, None, "t0", "t1")
    assert SlotState.from_entry(state.to_entry()) == state
    assert SlotState.from_entry(SlotState(model="m").to_entry()).model == "m"


def test_format_2_flags_become_phases():
    old = {"format": 2, "slots": {
        "0": {"active": "A", "active_key": "kA", "active_persistent": True, "unsaved": True},
        "1": {"active": "B", "active_key": "kB", "slot_unknown": True, "unsaved": True},
        "2": {"active": "C", "active_key": "kC", "unsaved": False},
        "3": {"active": "default", "active_key": None}}}
    slots = migrate_state(old)["slots"]
    assert {k: v["phase"] for k, v in slots.items()} == \
        {"0": "unsaved", "1": "unproven", "2": "ours", "3": "empty"}
    assert not any("unsaved" in v or "slot_unknown" in v for v in slots.values())


def test_a_format_1_file_is_migrated_through_every_step(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps(
        {"active": "A", "active_key": "kA", "active_persistent": True, "slot_tokens": 9}))
    store = SessionStore(tmp_path, legacy_slot=2)
    assert store.migrate_state_file()
    assert json.loads((tmp_path / STATE_FILE).read_text())["format"] == 3
    state = SlotTable(store).get(2)
    assert (state.phase, state.key, state.tokens) == (Phase.OURS, "kA", 9)


def test_a_newer_state_file_is_refused_with_the_fix(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps({"format": 4, "slots": {}}))
    with pytest.raises(StateFormatError, match="newer kvproxy .format 4.*move the file aside"):
        SlotTable(SessionStore(tmp_path)).read()


def test_a_switch_off_names_the_cause_and_the_fix_from_the_model_s_header():
    from kvproxy.slots.restore_check import UNKNOWN_CAUSE, cause_of
    assert "--swa-full" in cause_of({"gemma3.attention.sliding_window": 512})
    hybrid = cause_of({"general.architecture": "lfm2"})
    assert "hybrid or recurrent model (lfm2)" in hybrid and "cannot be restored" in hybrid
    assert cause_of({"general.architecture": "llama"}) == UNKNOWN_CAUSE
    assert cause_of({}) == UNKNOWN_CAUSE, "an unreadable model file names no fix"


def test_the_table_is_parsed_again_only_when_the_file_changed(tmp_path, monkeypatch):
    """Another process's write (another table on the folder) and this table's own are both
    read; an unchanged file is not parsed again."""
    store = SessionStore(tmp_path)
    mine, other = SlotTable(store), SlotTable(SessionStore(tmp_path))
    ours = SlotState(Phase.OURS, session_id="a", key="a", stem="a-1", persistent=True)
    mine.put(0, ours)
    assert mine.get(0) == ours
    reads = []
    parse = store.read_table
    monkeypatch.setattr(store, "read_table", lambda: reads.append(1) or parse())
    assert mine.get(0) == ours and mine.read() == {0: ours}
    assert reads == []
    theirs = ours.to(Phase.UNSAVED, tokens=7)
    other.put(0, theirs)
    assert mine.get(0) == theirs and reads == [1]
    mine.put(1, ours)
    assert mine.read() == {0: theirs, 1: ours}
    store.state_file.unlink()
    assert mine.get(0) == SlotState() and mine.read() == {}
