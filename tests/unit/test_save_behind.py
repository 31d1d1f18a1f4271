"""Saving new turns in the background once a slot has settled (stubbed llama-server)."""
import threading
import time

from kvproxy.slots import plan
from kvproxy.slots.plan import Save, SwapFacts
from kvproxy.slots.save_behind import SaveBehind
from kvproxy.slots.state import Phase, SlotState
from kvproxy.slots.switch import RESTORED
from tests.fake_llama import MODEL, make_switch
from tests.support import metric, turn, A, B


def saves_of(fake, session):
    return [a for a in fake.actions if a == ("save", f"{session.stem}.saving.bin")]


def test_a_burst_of_answers_is_saved_once_after_it_settles():
    saved, done = [], threading.Event()
    saver = SaveBehind(lambda slot: saved.append((slot, time.monotonic())) or done.set(), 0.2)
    started = time.monotonic()
    for _ in range(5):                      # five turns in quick succession
        saver.arm(0)
        time.sleep(0.05)
    assert done.wait(5)
    time.sleep(0.3)
    assert [slot for slot, _ in saved] == [0], "coalesced: one save"
    assert saved[0][1] - started >= 0.2 + 4 * 0.05 - 0.01, "only once the slot settled"
    assert saver.pending() == set()


def test_a_settled_slot_is_saved_and_the_swap_then_only_restores(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake, 40)
    assert switch.table.get(0).phase is Phase.UNSAVED
    before = metric("kvproxy_saves_behind_total")
    assert switch.save_settled(0) is True
    assert saves_of(fake, A) == [("save", f"{A.stem}.saving.bin")]
    assert switch.table.get(0).phase is Phase.OURS
    assert switch.store.read_sidecar(A.stem)["n_tokens"] == 40
    assert metric("kvproxy_saves_behind_total") == before + 1
    assert switch.save_settled(0) is False, "nothing new to save"
    fake.actions.clear()
    turn(switch, B, fake, 30)               # B takes the slot: A is not saved again
    assert saves_of(fake, A) == []
    fake.actions.clear()
    assert turn(switch, A, fake, 50).cache == RESTORED
    assert saves_of(fake, B) == [("save", f"{B.stem}.saving.bin")], "B had not settled"


def upstream_calls(fake, since=0):
    """(method, path) of every call to the stub since ``since``."""
    from urllib.parse import urlsplit
    return [(c.request.method, urlsplit(c.request.url).path) for c in fake.mock.calls[since:]]


def test_a_swap_after_a_save_behind_asks_nothing_but_the_restore(tmp_path, fake):
    """Its outgoing session is on disk, so whatever the slot holds is overwritten: no /slots,
    no save, and llama-server's fingerprint is not asked again while its connection is open;
    the restore is recorded in the sidecar with the request, after the answer."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake, 40)
    turn(switch, B, fake, 30)
    assert switch.save_settled(0) is True
    switch.client.still_open = lambda witness: True  # the stub has no real connection
    since = len(fake.mock.calls)
    lease = switch.acquire(A)
    assert lease.cache == RESTORED
    assert upstream_calls(fake, since) == [("POST", "/slots/0")]
    restores = switch.store.read_sidecar(A.stem).get("restores") or 0
    switch.release(lease, {"cache_n": 40, "prompt_n": 2, "predicted_n": 0})
    assert switch.store.read_sidecar(A.stem)["restores"] == restores + 1
    since = len(fake.mock.calls)
    turn(switch, B, fake, 35)               # A has turns its file lacks: proven, then saved
    assert upstream_calls(fake, since)[:2] == [("GET", "/slots"), ("POST", "/slots/0")]
    switch.client.still_open = lambda witness: False  # llama-server restarted
    since = len(fake.mock.calls)
    switch.save_settled(0)
    turn(switch, A, fake, 45)
    assert ("GET", "/props") in upstream_calls(fake, since), "the fingerprint is asked again"


def test_a_busy_unproven_or_off_slot_is_not_saved_behind(tmp_path, fake, monkeypatch):
    switch = make_switch(tmp_path)
    turn(switch, A, fake, 40)
    lease = switch.acquire(A)               # a request holds the slot
    assert switch.save_settled(0) is False and saves_of(fake, A) == []
    switch.release(lease, {"cache_n": 40, "prompt_n": 2, "predicted_n": 0})
    fake.tokens = 99                        # the slot no longer holds what kvproxy left there
    assert switch.save_settled(0) is False and saves_of(fake, A) == []
    fake.tokens = 42
    monkeypatch.setattr(switch.restore_check, "restoring_off", lambda key: True)
    assert switch.save_settled(0) is False and saves_of(fake, A) == []
    monkeypatch.undo()
    assert switch.save_settled(0) is True


def test_the_switch_saves_behind_on_its_own_after_the_delay(tmp_path, fake):
    switch = make_switch(tmp_path, save_behind=True, save_behind_delay=0.1)
    turn(switch, A, fake, 40)
    deadline = time.monotonic() + 5
    while switch.table.get(0).phase is not Phase.OURS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert switch.table.get(0).phase is Phase.OURS and len(saves_of(fake, A)) == 1


def test_the_plan_saves_only_turns_the_file_lacks():
    facts = dict(slot=0, session=B, view=plan.OURS, made_by={"model_path": "/m/tiny.gguf"})
    base = SlotState(phase=Phase.UNSAVED, session_id="A", key="A", stem=A.stem,
                     persistent=True, tokens=40, model=MODEL)
    unsaved = plan.plan_swap(SwapFacts(state=base, **facts))
    saved = plan.plan_swap(SwapFacts(state=base.to(Phase.OURS), **facts))
    assert isinstance(unsaved[0], Save)
    assert not any(isinstance(a, (Save, plan.KeepFile)) for a in saved)


def test_a_delete_during_the_sessions_restore_is_not_undone_by_a_later_save(tmp_path, fake):
    """DELETE /api/sessions/A reads the table before A's next turn claims the slot and removes
    A's files while llama-server restores one: the lease must not record A, or the save
    behind writes the deleted conversation back and A's next turn is a hit on it."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake, 40)
    turn(switch, B, fake, 30)                   # A saved at the swap; the slot holds B
    reached, go = threading.Event(), threading.Event()
    delete = switch.store.delete

    def delete_once_the_restore_began(stem):
        reached.set()
        assert go.wait(5)
        return delete(stem)
    switch.store.delete = delete_once_the_restore_began
    forgot = []
    deleting = threading.Thread(target=lambda: forgot.append(switch.forget("A")))
    deleting.start()
    assert reached.wait(5), "the deletion found no slot holding A and deletes its files"
    restore = fake._slot_action

    def restore_while_deleted(slot, action, filename):
        answer = restore(slot, action, filename)  # llama-server has read the file
        if action == "restore":
            go.set()
            deleting.join(5)
        return answer
    fake._slot_action = restore_while_deleted
    lease = turn(switch, A, fake, 50)
    assert lease.cache == RESTORED and forgot == [True]
    assert not list(tmp_path.glob(f"{A.stem}*"))
    switch.save_settled(0)
    assert not list(tmp_path.glob(f"{A.stem}*")), "the deleted conversation was saved back"
    assert switch.acquire(A).cache != plan.HIT, "the deleted conversation was served again"


def test_a_slot_emptied_meanwhile_is_seen_before_the_fingerprint_is_asked(tmp_path, fake):
    """Behind llama-server's router, ``/props`` of an unloaded model loads it again (``/slots``
    is asked without autoload): a slot whose model was unloaded is seen to hold nothing
    first, and nothing is loaded to learn that there is nothing to save."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake, 40)
    fake.tokens = 0                          # the router unloaded the model: the slot is gone
    asked = len(fake.mock.calls)
    assert switch.save_settled(0) is False
    urls = [call.request.url for call in list(fake.mock.calls)[asked:]]
    assert not [url for url in urls if "/props" in url or "/v1/models" in url], urls
    assert saves_of(fake, A) == []
