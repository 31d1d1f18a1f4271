"""The swap plan, from facts alone: each case the switch handles, as the actions it needs.

No HTTP stub and no slot folder: ``SwapFacts`` is what the switch gathered (the
typed slot state, what /slots showed, the sidecars of the files it may restore),
and ``plan_swap`` answers with the actions the executor then performs.
"""
from __future__ import annotations

from dataclasses import replace

from kvproxy.sessions.identity import Session, base_stem
from kvproxy.slots.plan import (BASE, EMPTY, FOREIGN, HIT, OURS, RESTORED, UNKNOWN, Claim, Erase,
                                FileFacts, KeepFile, MakeBase, Record, Refuse, Restore, Save, same_maker,
                                SwapFacts, is_hit, needs_slot_size, plan_swap,
                                swap_needs_view, view_without_asking)
from kvproxy.slots.answer import recorded_after
from kvproxy.slots.state import Phase, SlotState

MADE_BY = {"model_path": "m.gguf", "n_ctx": 4096, "build_info": "b1"}
A = Session("A", "header", system_hash="sysA", key="kA")
B = Session("B", "header", system_hash="sysB", key="kB")
HOLDS_A = SlotState(Phase.UNSAVED, session_id="A", key="kA", stem=A.stem, persistent=True,
                    system_hash="sysA", tokens=40)


def saved(stem: str, **sidecar) -> FileFacts:
    """A file on disk whose sidecar says this llama-server made it."""
    return FileFacts(stem, True, {"saved_at": "t", "made_by": MADE_BY, "n_tokens": 30, **sidecar})


def facts(state=HOLDS_A, session=B, view=OURS, own=None, base=None, **more) -> SwapFacts:
    return SwapFacts(slot=0, state=state, session=session, view=view, made_by=MADE_BY,
                     own=own, base=base, has_prompt=True, **more)


def test_hit_the_slot_provably_holds_the_session():
    assert is_hit(HOLDS_A, "kA", OURS)
    assert not is_hit(HOLDS_A, "kB", OURS)
    for view in (EMPTY, FOREIGN, UNKNOWN):
        assert not is_hit(HOLDS_A, "kA", view), f"a slot seen {view} is never a hit"


def test_restore_the_session_s_own_file_after_saving_the_one_the_slot_holds():
    assert plan_swap(facts(own=saved(B.stem))) == [
        Save(0, HOLDS_A), Claim(0, B), Restore(0, B.stem, RESTORED), Erase(0),
        MakeBase(0, "sysB"), Record(0, B)]


def test_base_a_new_conversation_restores_its_system_prompt_s_snapshot():
    base = saved(base_stem("sysB"))
    assert plan_swap(facts(own=FileFacts(B.stem), base=base)) == [
        Save(0, HOLDS_A), Claim(0, B), Restore(0, base.stem, BASE), Erase(0), Record(0, B)]


def test_miss_nothing_to_restore_erases_and_makes_the_base_snapshot():
    assert plan_swap(facts(own=FileFacts(B.stem), base=FileFacts(base_stem("sysB")))) == [
        Save(0, HOLDS_A), Claim(0, B), Erase(0), MakeBase(0, "sysB"), Record(0, B)]
    no_prompt = replace(facts(own=FileFacts(B.stem)), has_prompt=False)
    assert MakeBase(0, "sysB") not in plan_swap(no_prompt), "no prompt to tokenize"
    off = replace(facts(own=saved(B.stem)), base_snapshots=False)
    assert MakeBase(0, "sysB") not in plan_swap(off)


def test_foreign_slot_is_never_saved_over_its_session_s_file():
    for view in (FOREIGN, EMPTY):
        actions = plan_swap(facts(view=view, own=saved(B.stem)))
        assert actions[0] == KeepFile(0, HOLDS_A, view)
        assert not [a for a in actions if isinstance(a, Save)]


def test_unproven_slot_is_never_saved_and_its_session_comes_back_from_its_file():
    unproven = HOLDS_A.to(Phase.UNPROVEN)
    assert view_without_asking(unproven, uncertain=False, open_since=True) == UNKNOWN
    assert view_without_asking(HOLDS_A, uncertain=True, open_since=True) == UNKNOWN
    same_session = plan_swap(facts(state=unproven, session=A, view=UNKNOWN, own=saved(A.stem)))
    assert same_session[:3] == [KeepFile(0, unproven, UNKNOWN), Claim(0, A),
                                Restore(0, A.stem, RESTORED)]


def test_file_too_big_for_the_slot_is_refused_and_recorded():
    big = saved(B.stem, n_tokens=5000)
    actions = plan_swap(facts(own=big, n_ctx=4096))
    refused = next(a for a in actions if isinstance(a, Refuse))
    assert (refused.stem, refused.metric, refused.record, refused.quarantine) == \
        (B.stem, "too_big", True, False)
    assert "5000 tokens, more than the 4096-token context of slot 0" in refused.reason
    assert not [a for a in actions if isinstance(a, Restore)]
    assert needs_slot_size(facts(own=big)), "the slot's size is asked only when it decides"
    assert not needs_slot_size(facts(own=FileFacts(B.stem)))


def test_fingerprint_mismatch_is_refused_and_the_base_tried_next():
    other = FileFacts(B.stem, True, {"saved_at": "t", "made_by": {**MADE_BY, "build_info": "b2"}})
    base = saved(base_stem("sysB"))
    actions = plan_swap(facts(own=other, base=base))
    refused = actions[2]
    assert isinstance(refused, Refuse) and refused.metric == "model_mismatch" and refused.record
    assert actions[3] == Restore(0, base.stem, BASE)


def test_the_kv_format_counts_only_when_both_the_file_and_the_server_know_it():
    """Another cache type or V layout is refused before llama-server sees it; a file saved
    before the format was read is judged on the rest of the fingerprint."""
    f16, q8 = {**MADE_BY, "kv_format": "k=f16 v=f16"}, {**MADE_BY, "kv_format": "k=q8_0 v=q8_0"}
    assert same_maker(MADE_BY, f16) and same_maker(f16, MADE_BY) and same_maker(f16, f16)
    assert not same_maker(f16, q8)
    assert not same_maker({**MADE_BY, "n_ctx": 8192}, f16) and not same_maker(None, f16)
    other_format = saved(B.stem, made_by=f16)
    actions = plan_swap(replace(facts(own=other_format), made_by=q8))
    assert actions[2].metric == "model_mismatch" and Restore(0, B.stem, RESTORED) not in actions


def test_a_file_llama_server_refused_is_not_offered_to_it_again_and_a_refused_base_is_remade():
    refused = saved(B.stem, refused="invalid slot save file", refused_by=MADE_BY)
    actions = plan_swap(facts(own=refused))
    assert Restore(0, B.stem, RESTORED) not in actions
    assert Refuse(B.stem, "llama-server refused it before: invalid slot save file",
                  "refused") in actions
    elsewhere = saved(B.stem, refused="invalid slot save file",
                      refused_by={**MADE_BY, "build_info": "b0"})
    assert Restore(0, B.stem, RESTORED) in plan_swap(facts(own=elsewhere)), \
        "refused by another llama-server: this one may take it"
    base = saved(base_stem("sysB"), refused="invalid slot save file", refused_by=MADE_BY)
    assert plan_swap(facts(own=FileFacts(B.stem), base=base))[-2:] == [
        MakeBase(0, "sysB"), Record(0, B)]


def test_a_file_that_does_not_match_its_sidecar_is_quarantined():
    short = replace(saved(B.stem), size_problem="it has 10 bytes, its sidecar says 20")
    refused = [a for a in plan_swap(facts(own=short)) if isinstance(a, Refuse)]
    assert refused == [Refuse(B.stem, "it has 10 bytes, its sidecar says 20", "bad_file",
                              quarantine=True)]
    unrecorded = FileFacts(B.stem, True, {"made_by": MADE_BY})
    assert [a.metric for a in plan_swap(facts(own=unrecorded)) if isinstance(a, Refuse)] == [None]


def test_eviction_with_save_only_a_persistent_session_is_saved_first():
    side = replace(HOLDS_A, persistent=False)
    assert plan_swap(facts(state=side))[0] == Claim(0, B), "a side request's slot is not saved"
    assert plan_swap(facts(state=SlotState()))[0] == Claim(0, B), "an empty slot"
    assert plan_swap(facts())[0] == Save(0, HOLDS_A)


def test_restoring_off_restores_nothing_saves_nothing_and_makes_no_base():
    """No disk is spent on files llama-server would not honour."""
    assert plan_swap(facts(own=saved(B.stem), restoring_off=True)) == [
        KeepFile(0, HOLDS_A, OURS, restoring_off=True), Claim(0, B), Erase(0), Record(0, B)]


def test_a_side_session_never_restores():
    side = Session("side", "side", persistent=False)
    assert plan_swap(facts(session=side, own=saved(side.stem))) == [
        Save(0, HOLDS_A), Claim(0, side), Erase(0), Record(0, side)]


def test_after_an_answer_a_persistent_session_has_unsaved_turns():
    ours = HOLDS_A.to(Phase.OURS)
    assert recorded_after(ours, A, held=52, used_at="t2", several_slots=False,
                          since_written=0.0) == ours.to(Phase.UNSAVED, tokens=52, used_at="t2")
    unproven = HOLDS_A.to(Phase.UNPROVEN)
    assert recorded_after(unproven, A, 40, "t2", False, 0.0) is None, \
        "an unproven slot stays unproven"


def test_a_hit_writes_its_last_use_alone_at_most_once_a_second_and_only_with_several_slots():
    same = HOLDS_A
    assert recorded_after(same, A, 40, "t2", several_slots=False, since_written=5.0) is None
    assert recorded_after(same, A, 40, "t2", several_slots=True, since_written=0.5) is None
    assert recorded_after(same, A, 40, "t2", several_slots=True,
                          since_written=1.0) == replace(same, used_at="t2")


def test_a_fork_restores_the_file_it_was_forked_from_and_is_recorded_as_itself():
    fork = Session("F", "conversation-hash", system_hash="sysB", key="kF", seed="kC")
    seed = saved(fork.seed_stem)
    actions = plan_swap(facts(session=fork, own=FileFacts(fork.stem), seed=seed,
                              base=saved(base_stem("sysB"))))
    assert actions == [Save(0, HOLDS_A), Claim(0, fork), Restore(0, seed.stem, RESTORED),
                       Restore(0, base_stem("sysB"), BASE), Erase(0), Record(0, fork)]
    own_first = plan_swap(facts(session=fork, own=saved(fork.stem), seed=seed))
    assert [a.stem for a in own_first if isinstance(a, Restore)] == [fork.stem, seed.stem]
    other = saved(fork.seed_stem, made_by={"model_path": "other.gguf"})
    assert not [a for a in plan_swap(facts(session=fork, seed=other)) if isinstance(a, Restore)]
    assert fork.seed_stem != fork.stem and fork.seed_stem == Session("C", "x", key="kC").stem


def test_a_fork_takes_over_the_slot_that_holds_its_seed_after_saving_it():
    from kvproxy.slots.plan import Adopt
    fork = Session("F", "conversation-hash", system_hash="sysA", key="kF", seed="kA")
    actions = plan_swap(facts(session=fork, own=FileFacts(fork.stem), seed=FileFacts(A.stem)))
    assert actions == [Save(0, HOLDS_A), Claim(0, fork), Adopt(0, A.stem, 40), Record(0, fork)]
    unknown = plan_swap(facts(session=fork, view=UNKNOWN, seed=saved(A.stem)))
    assert not [a for a in unknown if isinstance(a, Adopt)], "only a slot proven to hold it"


def test_a_swap_asks_slots_only_when_its_plan_depends_on_it():
    assert swap_needs_view(HOLDS_A, B, restoring_off=False), "turns to save need proof"
    saved_behind = HOLDS_A.to(Phase.OURS)
    assert not swap_needs_view(saved_behind, B, restoring_off=False)
    assert not swap_needs_view(SlotState(), B, restoring_off=False)
    assert swap_needs_view(saved_behind, B, restoring_off=True), "an emptied slot is probed"
    fork = Session("F", "header", key="kF", seed="kA")
    assert swap_needs_view(saved_behind, fork, restoring_off=False), "the seed taken over"
    assert not swap_needs_view(saved_behind, Session("F", "header", key="kF", seed="kZ"), False)
