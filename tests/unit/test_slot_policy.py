"""The slot decisions outside the swap, from facts alone, as the actions they return.

The one save rule (used by the swap, the save behind, the checkpoint and side requests), the
bookkeeping after an answer, the restore probe's steps and what it leaves behind, the
executor's policy helpers and the waiting queue's rules: each compared as lists of actions or
decisions, the way ``test_swap_plan.py`` tests ``plan_swap``.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from kvproxy.sessions.identity import Session
from kvproxy.slots import plan
from kvproxy.slots import state as state_module
from kvproxy.slots.answer import (AnswerFacts, CountHit, CountTokens, NoteRestore, NoteWitness,
                                  RanATask, VerifyRestore, after_answer)
from kvproxy.slots.plan import (EMPTY, FOREIGN, HIT, OURS, RESTORED, UNKNOWN, KeepFile,
                                MarkUnproven, NoteKvFormat, Save, WriteRecord, save_or_keep)
from kvproxy.slots.queue import (MAX_OVERTAKEN, Kept, Waiter, join, keep_on_give_back,
                                 overtaken_by_take, serving_order)
from kvproxy.slots.restore_probe import (PROBE_TEXT, Completion, ListSlots, PrefillTokens,
                                         ProbeVerdict, ReadKvFormat, RemoveFile, SlotCall,
                                         Tokenize, after_probe, probe, spare_slot)
from kvproxy.slots.state import Phase, SlotState, emptied
from kvproxy.upstream.llama import UpstreamError, UpstreamUnavailable

A = Session("A", "header", system_hash="sysA", key="kA")
UNSAVED_A = SlotState(Phase.UNSAVED, session_id="A", key="kA", stem=A.stem, persistent=True,
                      system_hash="sysA", tokens=40)
SAVED_A = UNSAVED_A.to(Phase.OURS)


# -- the one save rule ---------------------------------------------------------------------
def test_a_slot_is_saved_only_when_a_fresh_view_proves_it_holds_its_session():
    assert save_or_keep(0, UNSAVED_A, OURS) == Save(0, UNSAVED_A)
    for view in (EMPTY, FOREIGN, UNKNOWN):
        assert save_or_keep(0, UNSAVED_A, view) == KeepFile(0, UNSAVED_A, view), view


def test_nothing_is_saved_while_restoring_is_off():
    assert save_or_keep(0, UNSAVED_A, OURS, restoring_off=True) == \
        KeepFile(0, UNSAVED_A, OURS, restoring_off=True)


def test_a_file_that_has_the_turns_is_saved_again_only_by_the_checkpoint():
    assert save_or_keep(0, SAVED_A, OURS) == KeepFile(0, SAVED_A, OURS)
    assert save_or_keep(0, SAVED_A, OURS, again=True) == Save(0, SAVED_A)
    assert save_or_keep(0, SAVED_A, EMPTY, again=True) == KeepFile(0, SAVED_A, EMPTY)


def test_a_slot_that_keeps_no_file_is_never_saved():
    side = replace(UNSAVED_A, persistent=False)
    assert save_or_keep(0, side, OURS, again=True) == KeepFile(0, side, OURS)
    unproven = UNSAVED_A.to(Phase.UNPROVEN)
    assert save_or_keep(0, unproven, OURS, again=True) == KeepFile(0, unproven, OURS)


# -- after an answer -------------------------------------------------------------------------
TIMINGS = {"cache_n": 30, "prompt_n": 10, "predicted_n": 12}


def answered(**more) -> AnswerFacts:
    facts = dict(slot=0, session=A, cache=HIT, timings=TIMINGS, figures=TIMINGS,
                 state=SAVED_A, held=52, used_at="t2", now="t3")
    return AnswerFacts(**{**facts, **more})


def hit_fields(**more) -> dict:
    return {"session_id": "A", "last_used_at": "t3", "last_cache": HIT, "last_cache_n": 30,
            "last_prompt_n": 10, **more}


def test_a_hit_counts_records_the_unsaved_turns_and_counts_the_sidecar():
    assert after_answer(answered()) == [
        CountTokens(30, 10), RanATask(), NoteWitness(0),
        WriteRecord(0, SAVED_A.to(Phase.UNSAVED, tokens=52, used_at="t2"), answered=True),
        CountHit(A.stem, "A", ("hits",), hit_fields())]


def test_a_session_deleted_during_its_request_leaves_its_slot_unproven():
    assert after_answer(answered(deleted=True)) == [CountTokens(30, 10), RanATask(),
                                                    MarkUnproven(0)]


def test_an_answer_without_timings_ran_no_task_and_verifies_nothing():
    facts = answered(timings={}, figures={}, cache=RESTORED, held=0, state=UNSAVED_A,
                     swapped=True)
    assert after_answer(facts) == [
        CountTokens(0, 0), NoteWitness(0), WriteRecord(0, UNSAVED_A, answered=True),
        CountHit(A.stem, "A", ("hits",), hit_fields(last_cache=RESTORED, last_cache_n=0,
                                                   last_prompt_n=0))]


def test_a_restore_of_its_own_file_is_verified_and_counted_in_its_own_sidecar():
    note = {"restore_ms": 5.0, "last_used_at": "t1", "restored_into_slot": 0}
    facts = answered(cache=RESTORED, restored_stem=A.stem, restore_note=note, fingerprint="k",
                     state=SAVED_A, swapped=True)
    assert after_answer(facts) == [
        CountTokens(30, 10), RanATask(), NoteWitness(0),
        WriteRecord(0, SAVED_A.to(Phase.UNSAVED, tokens=52, used_at="t2"), answered=True),
        VerifyRestore(None, 30, "k"),
        CountHit(A.stem, "A", ("hits", "restores"),
                 hit_fields(last_cache=RESTORED, restore_ms=5.0, restored_into_slot=0))]


def test_a_restore_of_another_file_is_counted_in_that_file():
    note = {"restore_ms": 5.0, "last_used_at": "t1", "restored_into_slot": 0}
    facts = answered(cache=RESTORED, restored_stem="base.x", restored_saved_at="s",
                     restore_note=note, fingerprint="k")
    actions = after_answer(facts)
    assert NoteRestore("base.x", "s", note) in actions
    assert actions[-1] == CountHit(A.stem, "A", ("hits",), hit_fields(last_cache=RESTORED))


def test_a_side_request_counts_no_sidecar_and_its_trail_goes_with_a_conversation():
    side = Session("side", "side", persistent=False)
    assert not any(isinstance(a, CountHit)
                   for a in after_answer(answered(session=side, state=SlotState())))
    trailed = Session("A", "header", system_hash="sysA", key="kA", trail="t-1")
    assert after_answer(answered(session=trailed))[-1] == \
        CountHit(trailed.stem, "A", ("hits",), hit_fields(trail="t-1"))


# -- what the restore probe leaves behind -------------------------------------------------------
def test_a_finished_probe_leaves_the_slot_empty_and_tells_the_kv_format(monkeypatch):
    monkeypatch.setattr(state_module, "now_iso", lambda: "2026-01-01T00:00:00.000+00:00")
    verdict = ProbeVerdict(True, 120, 119, "f16")
    assert after_probe(1, UNSAVED_A, verdict) == [
        WriteRecord(1, emptied(UNSAVED_A, False)), NoteKvFormat("f16")]
    assert after_probe(1, UNSAVED_A, ProbeVerdict(False, 120, 0)) == [
        WriteRecord(1, emptied(UNSAVED_A, False))]


def test_a_probe_stopped_half_way_trusts_nothing_there():
    assert after_probe(1, UNSAVED_A, ProbeVerdict(None, touched=True)) == [MarkUnproven(1)]
    assert after_probe(1, UNSAVED_A, ProbeVerdict(None, touched=False)) == []


# -- the restore probe's steps ------------------------------------------------------------------
NAME = "probe.0123456789abcdef.bin"
TOKENS = list(range(130))
# llama-server's answers by step (a slot call by its action), as the probe receives them.
ANSWERS = {"Tokenize": TOKENS, "PrefillTokens": {}, "save": {"n_saved": 130}, "ReadKvFormat": "f16",
           "erase": {}, "restore": {"n_restored": 130},
           "Completion": {"timings": {"cache_n": 129, "prompt_n": 1}}, "RemoveFile": True}


def stepped(steps, asked: list | None = None, **changed) -> tuple[list, object]:
    """Drive ``steps`` as the executor does, with ``ANSWERS`` (``changed`` by name; an
    exception is thrown in): the steps it yielded (into ``asked``), and what it returned."""
    answers, asked, failure = {**ANSWERS, **changed}, [] if asked is None else asked, None
    answer = None
    while True:
        try:
            step = steps.send(answer) if failure is None else steps.throw(failure)
        except StopIteration as done:
            return asked, done.value
        asked.append(step)
        answer = answers[step.action if isinstance(step, SlotCall) else type(step).__name__]
        failure, answer = (answer, None) if isinstance(answer, BaseException) else (None, answer)


def probe_steps(slot: int, *, until: int = 8) -> list:
    """The probe's steps in ``slot``, the first ``until`` of them, then its file removed."""
    one_token = {"prompt": TOKENS, "n_predict": 1, "cache_prompt": True, "id_slot": slot,
                 "temperature": 0, "stream": False}
    steps = [Tokenize(PROBE_TEXT), PrefillTokens(slot, TOKENS), SlotCall(slot, "save", NAME),
             ReadKvFormat(NAME), SlotCall(slot, "erase"), SlotCall(slot, "restore", NAME),
             Completion(one_token), SlotCall(slot, "erase")]
    return steps[:until] + [RemoveFile(NAME)]


def test_the_probe_prefills_saves_erases_restores_asks_one_token_and_removes_its_file():
    assert stepped(probe(1, NAME)) == (probe_steps(1), ProbeVerdict(
        True, 130, 129, "f16", "129 of 130 restored tokens reused"))


def test_a_restore_recomputed_is_not_honoured():
    asked, verdict = stepped(probe(0, NAME), Completion={"timings": {"cache_n": 0}})
    assert asked == probe_steps(0)
    assert verdict == ProbeVerdict(False, 130, 0, "f16", "0 of 130 restored tokens reused")


def test_too_few_tokens_restored_prove_nothing():
    asked, verdict = stepped(probe(0, NAME), restore={"n_restored": 10})
    assert asked == probe_steps(0) and verdict.honoured is None and verdict.touched


@pytest.mark.parametrize("step, failure, until, touched", [
    ("Tokenize", UpstreamUnavailable("llama-server is down"), 1, False),
    ("save", UpstreamError(400, "save refused"), 3, True),
    ("restore", UpstreamError(400, "restore refused"), 6, True),
    ("Completion", {"timings": {"cache_n": "many"}}, 7, True),   # not what llama-server sends
])
def test_a_probe_stopped_half_way_says_why_and_still_removes_its_file(step, failure, until,
                                                                      touched):
    asked, verdict = stepped(probe(0, NAME), **{step: failure})
    assert asked == probe_steps(0, until=until)
    assert verdict.honoured is None and verdict.touched is touched
    assert verdict.detail.startswith("the restore probe could not finish: ")


def test_a_bug_in_a_step_goes_up_after_the_file_is_removed():
    asked: list = []
    with pytest.raises(RuntimeError, match="a bug"):
        stepped(probe(0, NAME), asked, restore=RuntimeError("a bug"))
    assert asked == probe_steps(0, until=6)


def test_the_probe_takes_a_spare_slot_without_asking_then_one_llama_server_emptied():
    held = SAVED_A.to(Phase.OURS, tokens=9)
    assert stepped(spare_slot([0, 1], {0: held, 1: SlotState(Phase.CLAIMED)})) == ([], 1)
    assert stepped(spare_slot([0, 1], {0: held})) == ([], 1), "no record: empty"
    listing = [{"id": 0, "id_task": 3, "n_prompt_tokens": 9},
               {"id": 1, "id_task": 4, "n_prompt_tokens": 0}]
    both = {0: held, 1: held}
    assert stepped(spare_slot([0, 1], both), ListSlots=listing) == ([ListSlots()], 1)
    listing[1]["n_prompt_tokens"] = 9
    assert stepped(spare_slot([0, 1], both), ListSlots=listing) == ([ListSlots()], None)
    assert stepped(spare_slot([0, 1], both), ListSlots=UpstreamUnavailable("down")) == \
        ([ListSlots()], None)


# -- the executor's policy ----------------------------------------------------------------------
def test_the_executor_policy_helpers():
    assert not plan.base_worth_making(None) and not plan.base_worth_making([1] * 31)
    assert plan.base_worth_making([1] * plan.MIN_BASE_TOKENS)
    assert plan.save_protected("a", {"b"}, {"c"}) == {"a", "b", "c"}
    assert plan.trim_after_save(11, 10) and not plan.trim_after_save(10, 10)
    assert plan.remember_refusal(400, {"m": 1})
    assert not plan.remember_refusal(400, None), "an unconfirmed fingerprint"
    assert not plan.remember_refusal(500, {"m": 1}), "only llama-server's 400"


# -- the waiting queue -----------------------------------------------------------------------
def test_a_returning_conversation_joins_before_the_new_ones_and_counts_them_overtaken():
    new1, short, new2, new3 = Waiter("n1", False), Waiter("r", False, True), \
        Waiter("n2", False), Waiter("n3", False)
    queue = [new1, short, new2, new3]
    assert join(queue, short=True) == join(queue, True)
    joined = join(queue, short=True)
    assert joined.index == 2 and joined.passed == (new2, new3)
    assert join(queue, short=True, counts=False).passed == ()
    assert join(queue, short=False) == type(joined)(4)
    worn = Waiter("n4", False, overtaken=MAX_OVERTAKEN)
    assert join([new1, worn], short=True).index == 2


def test_with_several_slots_the_first_new_conversation_is_served_first():
    short, new = Waiter("r", False, True), Waiter("n", False)
    assert serving_order([short, new], several_slots=True, serving_new=False) == [new, short]
    assert serving_order([short, new], several_slots=True, serving_new=True) == [short, new]
    assert serving_order([short, new], several_slots=False, serving_new=False) == [short, new]


def test_a_slot_is_kept_only_while_new_conversations_wait_and_never_all_slots():
    new = Waiter("n", False, deadline=100.0)
    assert keep_on_give_back("A", 2.0, 10.0, {}, 1, [new]) == Kept("A", 12.0)
    assert keep_on_give_back("A", 2.0, 10.0, {}, 1, []) is None, "nobody to keep it from"
    assert keep_on_give_back(None, 2.0, 10.0, {}, 1, [new]) is None, "a side request"
    assert keep_on_give_back("A", 0.0, 10.0, {}, 1, [new]) is None, "keeps are off"
    assert keep_on_give_back("A", 2.0, 10.0, {1: Kept("B", 11.0)}, 1, [new]) is None
    assert keep_on_give_back("A", 2.0, 10.0, {1: Kept("B", 9.0)}, 1, [new]) == Kept("A", 12.0)
    assert keep_on_give_back("A", 2.0, 99.0, {}, 1, [new]) is None, "would outlast its wait"


def test_the_kept_conversation_taking_its_slot_overtakes_the_new_ones_waiting():
    taker, new, side = Waiter("A", False, True), Waiter("n", False), Waiter("s", True)
    queue = [taker, new, side]
    assert overtaken_by_take(taker, Kept("A", 5.0), False, queue) == [new]
    assert overtaken_by_take(taker, Kept("B", 5.0), False, queue) == []
    assert overtaken_by_take(taker, None, False, queue) == []
    assert overtaken_by_take(taker, Kept("A", 5.0), True, queue) == [], "a slot serves new ones"


def test_a_switch_built_without_settings_runs_the_shipped_defaults():
    """Tests that build a switch directly run what ships (save behind on, a slot kept 2 s),
    unless they say why not."""
    from kvproxy.config import load_settings
    from kvproxy.slots.switch import SwitchSettings
    assert SwitchSettings() == SwitchSettings.of(load_settings(environ={}))
    assert SwitchSettings().save_behind and SwitchSettings().slot_keep == 2


def test_keeps_run_out_and_end_when_no_new_conversation_waits():
    from kvproxy.slots.queue import keeps_needed, live_keeps
    kept = {0: Kept("A", 5.0), 1: Kept("B", 15.0)}
    assert live_keeps(kept, 10.0) == {1: Kept("B", 15.0)}
    assert keeps_needed([Waiter("n", False)])
    assert not keeps_needed([Waiter("r", False, True), Waiter("s", True)])
    assert not keeps_needed([Waiter("n", False, overtaken=MAX_OVERTAKEN)])
