"""llama-server's fingerprint during a swap: reused while proven, else asked beside the swap
and the swap redone when it changed (stubbed llama-server)."""
import json
import threading

from kvproxy.slots import plan
from kvproxy.slots.fingerprints import Asking
from kvproxy.slots.plan import Claim, Erase, MakeBase, Record, Restore, Save
from kvproxy.slots.state import Phase, SlotState
from kvproxy.slots.switch import MISS, RESTORED
from tests.fake_llama import make_switch
from tests.support import A, B, turn


def settled_turn(switch, session, fake, tokens):
    """A turn, then its save behind."""
    lease = turn(switch, session, fake, tokens)
    switch.save_settled(lease.slot)
    return lease


def props_asked(fake, since):
    return sum(1 for c in fake.mock.calls[since:] if c.request.url.endswith("/props"))


def test_a_swap_plans_with_the_last_fingerprint_and_asks_it_again_beside_the_restore(
        tmp_path, fake):
    switch = make_switch(tmp_path)
    settled_turn(switch, A, fake, 40)
    settled_turn(switch, B, fake, 30)
    switch.client.still_open = lambda witness: False  # nothing proves llama-server the same
    since = len(fake.mock.calls)
    lease = switch.acquire(A)
    assert lease.cache == RESTORED and fake.actions[-1] == ("restore", f"{A.stem}.bin")
    assert props_asked(fake, since) == 1, "asked again, beside the restore"
    switch.release(lease)


def test_a_swap_is_done_again_when_llama_server_changed_meanwhile(tmp_path, fake):
    switch = make_switch(tmp_path)
    settled_turn(switch, A, fake, 40)
    settled_turn(switch, B, fake, 30)
    switch.client.still_open = lambda witness: False
    fake.props["model_path"] = "/models/other.gguf"  # restarted with another model
    fake.models["data"][0]["meta"] = {"size": 1, "n_params": 2}
    lease = switch.acquire(A)
    assert lease.made_by["model_path"] == "/models/other.gguf"
    assert lease.cache == MISS, "no file of the old model is kept in the slot"
    assert fake.actions[-2:] == [("restore", f"{A.stem}.bin"), ("erase", None)]
    assert switch.table.get(0).model == "other" and lease.session.model == "other"
    switch.release(lease)


def test_only_a_swap_that_writes_no_file_is_done_before_the_fingerprint_is_confirmed():
    state = SlotState()
    restoring = [Claim(0, A), Restore(0, A.stem, RESTORED), Erase(0), Record(0, A)]
    assert plan.undoable(restoring)
    assert not plan.undoable([Save(0, state)] + restoring)
    assert not plan.undoable(restoring[:-1] + [MakeBase(0, "aaaa"), Record(0, A)])


def test_swaps_that_ask_at_the_same_time_share_one_question(tmp_path, fake):
    switch = make_switch(tmp_path)
    settled_turn(switch, A, fake, 40)
    fingerprints = switch.fingerprints
    planned = fingerprints.now()
    release = threading.Event()
    asked = []
    real_ask = fingerprints._ask

    def slow_ask():
        asked.append(1)
        assert release.wait(10)
        return real_ask()

    fingerprints._ask = slow_ask
    first, second = Asking(fingerprints), Asking(fingerprints)
    first.start()
    second.start()
    release.set()
    assert first.changed(planned) is None and second.changed(planned) is None
    assert len(asked) == 1, "one question in flight serves both swaps"
    assert Asking(fingerprints).changed(planned) is None and len(asked) == 2, \
        "once answered, the next swap asks again"


def test_a_restoring_swap_writes_the_state_table_once_and_the_answer_writes_its_record(
        tmp_path, fake, monkeypatch):
    switch = make_switch(tmp_path)
    settled_turn(switch, A, fake, 40)
    settled_turn(switch, B, fake, 30)
    writes = []
    real_change = switch.store.change_table
    monkeypatch.setattr(switch.store, "change_table",
                        lambda change: writes.append(1) or real_change(change))
    lease = switch.acquire(A)
    assert lease.cache == RESTORED and len(writes) == 1, "the claim, before the restore"
    assert switch.table.get(0).phase is Phase.CLAIMED and switch.table.get(0).key == A.key
    assert switch.slot_listing()[0]["unproven"] is False, "this process knows the swap is done"
    switch.release(lease, {"cache_n": 40, "prompt_n": 5, "predicted_n": 2})
    assert len(writes) == 2, "the record comes with the request's own bookkeeping"
    state = switch.table.get(0)
    assert (state.phase, state.key, state.tokens) == (Phase.UNSAVED, A.key, 47)


def test_a_process_gone_before_the_answer_leaves_the_slot_untrusted(tmp_path, fake):
    switch = make_switch(tmp_path)
    settled_turn(switch, A, fake, 40)
    settled_turn(switch, B, fake, 30)
    dying = switch.acquire(A)               # restored; the process dies before the answer:
    dying._release()                        # its locks go with it, its bookkeeping is not done
    fake.actions.clear()
    restarted = make_switch(tmp_path)
    lease = restarted.acquire(A)
    assert lease.cache == RESTORED and fake.actions[0] == ("restore", f"{A.stem}.bin"), \
        "a claimed slot is never trusted: the file is restored again"
    restarted.release(lease)


ADAPTER = {"id": 0, "path": "/models/style-lora.gguf", "scale": 1.0, "task_name": "",
           "prompt_prefix": ""}


def test_the_fingerprint_names_the_lora_adapters_applied_and_only_those():
    """As GET /lora-adapters lists them (id, path, scale): one of scale 0 is loaded but
    applied to nothing, and a server without adapters keeps the fingerprint it had."""
    props, models = {"model_path": "m.gguf"}, {"data": []}
    bare = plan.fingerprint(props, models)
    assert plan.fingerprint(props, models, None, []) == bare
    assert plan.fingerprint(props, models, None, [{**ADAPTER, "scale": 0.0}]) == bare
    applied = plan.fingerprint(props, models, None, [ADAPTER])
    assert applied[plan.LORA] == [["/models/style-lora.gguf", 1.0]]
    halved = plan.fingerprint(props, models, None, [{**ADAPTER, "scale": 0.5}])
    assert not plan.same_maker(applied, bare) and not plan.same_maker(applied, halved)


def test_a_file_saved_under_a_lora_adapter_is_not_restored_under_another_set(tmp_path, fake):
    switch = make_switch(tmp_path)
    fake.lora = [ADAPTER]
    settled_turn(switch, A, fake, 40)
    turn(switch, B, fake, 30)
    assert switch.store.read_sidecar(A.stem)["made_by"][plan.LORA] == [[ADAPTER["path"], 1.0]]
    fake.lora = [{**ADAPTER, "scale": 0.0}]    # the adapter switched off
    switch.fingerprints.forget()
    lease = turn(switch, A, fake, 40)
    assert lease.cache == MISS and ("restore", f"{A.stem}.bin") not in fake.actions[-3:]


def test_setting_the_adapters_through_kvproxy_asks_the_fingerprint_again(tmp_path, fake):
    """``POST /lora-adapters`` changes llama-server without a restart, so the open connection
    that vouches for its fingerprint proves nothing about the adapters."""
    import responses

    from kvproxy import create_app
    from tests.fake_llama import UPSTREAM

    def set_scales(request):
        scales = {e["id"]: e["scale"] for e in json.loads(request.body)}
        fake.lora = [{**a, "scale": scales.get(a["id"], 0.0)} for a in fake.lora]
        return 200, {"Content-Type": "application/json"}, json.dumps({"success": True})
    fake.mock.add_callback(responses.POST, f"{UPSTREAM}/lora-adapters", callback=set_scales)
    fake.lora = [ADAPTER]
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM})
    switch = app.extensions["kvproxy.switch"]
    switch.client.still_open = lambda witness: True   # no restart: the connection vouches
    before = switch.current_made_by()
    assert app.test_client().post("/lora-adapters", json=[{"id": 0, "scale": 0.0}]
                                  ).status_code == 200
    after = switch.current_made_by()
    assert plan.LORA in before and plan.LORA not in after
