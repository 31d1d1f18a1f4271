"""Several slots on a stubbed llama-server: placement carried out, pinning, busy slots never
touched, processes sharing the folder, and the single-slot state file migrated."""
import json
import re
import threading
import time
from types import SimpleNamespace

import pytest
import responses

from kvproxy import create_app
from kvproxy.sessions.identity import Session
from kvproxy.slots.state import SlotState
from kvproxy.storage.store import (STATE_FILE, STATE_FORMAT, SessionStore, StateFormatError,
                                    now_iso)
from kvproxy.slots.placement import FREE
from kvproxy.slots.pool import Taken
from kvproxy.slots.switch import HIT, MISS, RESTORED, ClientGone, SlotBusy
from tests.fake_llama import UPSTREAM, FakeLlama, MODEL
from tests.support import metric, switch_over, PLAIN_A as A, PLAIN_B as B, PLAIN_C as C

SIDE = Session("side", "side-request", persistent=False, model=MODEL)


@pytest.fixture
def mock():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as m:
        yield m


def fake_with(mock, tmp_path, n_slots):
    return FakeLlama(mock, tmp_path, n_slots=n_slots)


def answer(switch, session, fake, tokens=20):
    lease = switch.acquire(session)
    fake.held[lease.slot] = tokens
    switch.release(lease, {"cache_n": 0, "prompt_n": tokens - 1, "predicted_n": 1})
    return lease


def actions_on(fake, slot):
    return [(a, f) for s, a, f in fake.slot_actions if s == slot]


def test_the_slot_count_comes_from_llama_server_unless_set(mock, tmp_path):
    fake_with(mock, tmp_path, 3)
    assert switch_over(tmp_path).slot_ids() == [0, 1, 2]
    assert switch_over(tmp_path, slots=2).slot_ids() == [0, 1]
    assert switch_over(tmp_path, slots=1, slot_id=2).slot_ids() == [2]


def test_the_slot_count_is_read_from_props_without_the_slot_listing(mock, tmp_path):
    """llama-server started with --no-slots still says in /props how many slots it has."""
    fake_with(mock, tmp_path, 3).slots_off = True
    assert switch_over(tmp_path).slot_ids() == [0, 1, 2]


@pytest.mark.parametrize("total", ["missing", 0, None])
def test_without_a_slot_count_in_props_the_slots_listed_are_counted(mock, tmp_path, total):
    """An older llama-server's /props has no total_slots; a count of no slots is no count."""
    fake = fake_with(mock, tmp_path, 3)
    if total == "missing":
        del fake.props["total_slots"]
    else:
        fake.props["total_slots"] = total
    assert switch_over(tmp_path).slot_ids() == [0, 1, 2]


def test_until_llama_server_lists_a_slot_kvproxy_drives_its_one_configured_slot(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    del fake.props["total_slots"]
    mock.replace(responses.GET, f"{UPSTREAM}/slots", json=[])
    switch = switch_over(tmp_path, slot_id=1)
    assert switch.slot_ids() == [1]
    mock.replace(responses.GET, f"{UPSTREAM}/slots", json={"slots": "not a list"})
    assert switch.slot_ids() == [1]
    mock.replace(responses.GET, f"{UPSTREAM}/slots", json=[fake.slot_entry(0), fake.slot_entry(1)])
    assert switch.slot_ids() == [0, 1], "asked again once llama-server lists its slots"


def test_two_sessions_hold_a_slot_each_and_run_at_the_same_time(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path)
    first = switch.acquire(A)
    second = switch.acquire(B)       # would block with one slot
    assert {first.slot, second.slot} == {0, 1}
    assert first.cache == second.cache == MISS
    fake.held[first.slot] = fake.held[second.slot] = 20
    switch.release(first, {"cache_n": 0, "prompt_n": 19, "predicted_n": 1})
    switch.release(second, {"cache_n": 0, "prompt_n": 19, "predicted_n": 1})
    assert [a for a, _ in fake.actions] == ["erase", "erase"], "nothing saved, nothing restored"
    again = answer(switch, B, fake)
    assert again.cache == HIT and again.slot == second.slot


def test_a_third_session_takes_the_least_recently_used_slot_after_saving_it(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path)
    slot_a = answer(switch, A, fake).slot
    slot_b = answer(switch, B, fake).slot
    time.sleep(0.01)
    assert answer(switch, A, fake).cache == HIT          # B is now the least recently used
    lease_c = answer(switch, C, fake)
    assert lease_c.slot == slot_b
    assert actions_on(fake, slot_b)[-2:] == [("save", f"{B.stem}.saving.bin"), ("erase", None)]
    assert actions_on(fake, slot_a) == [("erase", None)], "A's slot untouched"
    back = answer(switch, B, fake)                       # A is now the LRU: saved, B restored
    assert back.cache == RESTORED and back.slot == slot_a
    assert ("save", f"{A.stem}.saving.bin") in actions_on(fake, slot_a)


def test_a_busy_slot_is_never_touched_and_the_waiter_takes_the_first_to_free(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path, lock_timeout=10)
    held_a, held_b = switch.acquire(A), switch.acquire(B)
    before = list(fake.slot_actions)
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(switch.acquire(C)))
    waiter.start()
    deadline = time.monotonic() + 5
    while switch.pool.waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert switch.pool.waiting == 1
    time.sleep(0.3)
    assert fake.slot_actions == before, "no slot action while both slots are busy"
    fake.held[held_b.slot] = 30
    switch.release(held_b, {"cache_n": 0, "prompt_n": 29, "predicted_n": 1})
    waiter.join(5)
    assert outcome and outcome[0].slot == held_b.slot
    assert actions_on(fake, held_a.slot) == [("erase", None)], "A's busy slot was left alone"
    switch.release(outcome[0])
    switch.release(held_a)


def test_a_session_waits_for_its_own_busy_slot_rather_than_taking_another(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path, lock_timeout=0.4)
    held = switch.acquire(A)
    with pytest.raises(SlotBusy):
        switch.acquire(A)   # slot 1 is idle, but A must never run in two slots
    assert actions_on(fake, 1) == []
    switch.release(held)


def test_a_side_request_runs_beside_a_conversation_without_costing_anyone_a_save(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path, lock_timeout=1)
    conversation = switch.acquire(A)
    side = switch.acquire(SIDE)      # while A streams
    assert side.slot != conversation.slot
    assert not [a for a, _ in fake.actions if a == "save"]
    switch.release(side)
    switch.release(conversation)


def test_a_side_request_saves_the_conversation_whose_idle_slot_it_takes(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path, lock_timeout=1)
    answer(switch, A, fake)
    held_b = switch.acquire(B)
    side = switch.acquire(SIDE)
    slot_a = 1 - held_b.slot
    assert side.slot == slot_a
    assert ("save", f"{A.stem}.saving.bin") in actions_on(fake, slot_a)
    switch.release(side)
    switch.release(held_b)
    assert answer(switch, A, fake).cache == RESTORED


def test_every_request_through_the_app_is_pinned_to_its_slot(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                         "base_snapshots": False}).test_client()
    sessions = ["one", "two", "one", "two"]
    for name in sessions:
        reply = client.post("/v1/chat/completions", headers={"X-Session-Id": name},
                            json={"messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200
    assert fake.pinned == [0, 1, 0, 1]
    table = SessionStore(tmp_path).read_table()
    assert {table[0]["active"], table[1]["active"]} == {"one", "two"}
    slots = client.get("/api/slots").get_json()
    assert [(s["id"], s["session_id"], s["busy"]) for s in slots] == \
        [(0, "one", False), (1, "two", False)]


def test_two_processes_on_one_folder_never_share_a_slot(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    first, second = switch_over(tmp_path, lock_timeout=2), switch_over(tmp_path, lock_timeout=2)
    held = first.acquire(A)
    other = second.acquire(B)        # the table shows slot 0 idle to it; its lock does not
    assert other.slot != held.slot
    second.release(other)
    started = time.monotonic()
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(second.acquire(A)))
    waiter.start()
    time.sleep(0.3)
    assert not outcome, "A is busy in the other process: the second waits for that slot"
    fake.held[held.slot] = 20
    first.release(held, {"cache_n": 0, "prompt_n": 19, "predicted_n": 1})
    waiter.join(5)
    assert outcome and outcome[0].slot == held.slot and outcome[0].cache == HIT
    assert time.monotonic() - started < 3
    second.release(outcome[0])


def test_a_session_another_process_put_elsewhere_is_followed_there(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    first = switch_over(tmp_path)
    answer(first, A, fake)                 # slot 0
    second = switch_over(tmp_path)
    # The second process decided on slot 1 before it saw A's entry: the claim sends it on.
    from kvproxy.slots.executor import HeldElsewhere
    with pytest.raises(HeldElsewhere):
        second.swaps.swap_to(A, None, 1)
    lease = second.acquire(A)
    assert lease.slot == 0 and lease.cache == HIT
    second.release(lease)


def place_first_in_slot_1(switch, monkeypatch, first_wait=lambda: False):
    """The switch's first placement hands out slot 1, as if decided before another process
    put the session in slot 0 (``first_wait``: whether that placement waited); later
    placements are the pool's own."""
    take, stale = switch.pool.take, [True]

    def placed_before_the_table_changed(slot_ids, key, side, timeout=None, short=False):
        if stale.pop() if stale else False:
            switch.pool.lock(1).acquire()
            return Taken(1, first_wait(), FREE)
        return take(slot_ids, key, side, timeout=timeout, short=short)
    monkeypatch.setattr(switch.pool, "take", placed_before_the_table_changed)


def test_a_request_placed_before_another_process_moved_its_session_follows_it(
        mock, tmp_path, monkeypatch):
    """acquire's side of the race above: the slot it was given back is free again, and the
    request goes on to the slot that holds its session."""
    fake = fake_with(mock, tmp_path, 2)
    answer(switch_over(tmp_path), A, fake)          # another process: A in slot 0
    second = switch_over(tmp_path)
    place_first_in_slot_1(second, monkeypatch)
    lease = second.acquire(A)
    assert (lease.slot, lease.cache) == (0, HIT)
    assert second.pool.lock(1).try_acquire(), "the slot it was first given is free again"
    second.pool.give_back(1)
    second.release(lease)


def test_a_request_that_followed_its_session_waits_only_what_is_left_of_its_bound(
        mock, tmp_path, monkeypatch):
    """Its first placement used up the whole bound; the slot that holds its session is busy
    in another process: 503 at once, not a new wait (even one that would end in the slot)."""
    import kvproxy.slots.requests as switch_module  # the request path's clock
    fake = fake_with(mock, tmp_path, 2)
    other = switch_over(tmp_path)
    answer(other, A, fake)                          # another process: A in slot 0 ...
    held = other.acquire(A)                         # ... and busy there
    second = switch_over(tmp_path, lock_timeout=30)
    later = [0.0]
    monkeypatch.setattr(switch_module, "time",
                        SimpleNamespace(monotonic=lambda: time.monotonic() + later[0]))
    frees = threading.Timer(0.5, other.release, [held])

    def after_the_whole_wait():
        later[0] += 30                              # the wait for slot 1 took the whole bound
        frees.start()                               # slot 0 frees a moment later
        return True
    place_first_in_slot_1(second, monkeypatch, after_the_whole_wait)
    try:
        with pytest.raises(SlotBusy):
            second.acquire(A)
    finally:
        frees.join(10)


def test_a_client_that_left_while_its_request_followed_its_session_costs_no_swap(
        mock, tmp_path, monkeypatch):
    """Going to the slot that holds the session after a first placement counts as waiting:
    the client is asked whether it is still there, and nothing is swapped when it left."""
    fake = fake_with(mock, tmp_path, 2)
    answer(switch_over(tmp_path), A, fake)          # another process: A in slot 0
    second = switch_over(tmp_path)
    place_first_in_slot_1(second, monkeypatch)
    with pytest.raises(ClientGone):
        second.acquire(A, still_wanted=lambda: False)
    assert second.pool.lock(0).try_acquire(), "the slot is free again"
    second.pool.give_back(0)


def test_the_single_slot_state_file_is_migrated_without_losing_the_active_session(
        mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    old = {"active": "A", "active_key": A.key, "active_stem": A.stem,
           "active_persistent": True, "active_system_hash": None, "slot_tokens": 40,
           "slot_unknown": False, "updated_at": "2026-01-01T00:00:00.000+00:00"}
    (tmp_path / STATE_FILE).write_text(json.dumps(old))
    fake.held[0] = 40                      # what the old kvproxy left in its slot
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False})
    from kvproxy.ops.startup import check_at_start
    check_at_start(app)
    written = json.loads((tmp_path / STATE_FILE).read_text())
    assert written["format"] == STATE_FORMAT and written["slots"]["0"]["active"] == "A"
    switch = app.extensions["kvproxy.switch"]
    assert answer(switch, A, fake).cache == HIT, "the migrated slot still proves A"
    held = switch.acquire(A)
    lease_b = switch.acquire(B)            # slot 1, empty
    assert lease_b.slot == 1
    switch.release(lease_b)
    switch.release(held)
    switch.clear()
    assert ("save", f"{A.stem}.saving.bin") in actions_on(fake, 0)
    assert SessionStore(tmp_path).read_sidecar(A.stem)["n_tokens"] == 20


def test_a_state_file_from_a_newer_kvproxy_is_refused_loudly(mock, tmp_path):
    """Guessing at a newer format could save an unproven slot over a session's file: the
    swap refuses (a 503 to the client) and saves nothing; start-up stops with one line."""
    fake = fake_with(mock, tmp_path, 1)
    (tmp_path / STATE_FILE).write_text(json.dumps({"format": 99, "slots": {"0": {
        "active": "A", "active_key": A.key, "active_persistent": True, "slot_tokens": 40}}}))
    fake.held[0] = 40
    switch = switch_over(tmp_path)
    with pytest.raises(StateFormatError, match="format 99; this one reads formats 1 to 3"):
        switch.acquire(B)
    assert not [a for a, _ in fake.actions if a == "save"]
    assert not switch.busy(0), "the slot is free again"
    from kvproxy.ops.startup import ContractError, sweep_slot_folder
    with pytest.raises(ContractError, match="written by a newer kvproxy"):
        sweep_slot_folder(switch, wait=1)


def test_clear_takes_one_slot_or_all(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                         "base_snapshots": False}).test_client()
    for name in ("one", "two"):
        client.post("/v1/chat/completions", headers={"X-Session-Id": name},
                    json={"messages": [{"role": "user", "content": "hi"}]})
    reply = client.post("/api/sessions/clear?slot=1", json={})
    assert reply.status_code == 200 and reply.get_json()["slots"] == [1]
    table = SessionStore(tmp_path).read_table()
    assert table[0]["active"] == "one" and table[1]["active"] == "default"
    assert client.post("/api/sessions/clear?slot=7", json={}).status_code == 400
    assert client.post("/api/sessions/clear", json={}).get_json()["slots"] == [0, 1]
    assert all(e["active"] == "default" for e in SessionStore(tmp_path).read_table().values())
    current = client.get("/api/sessions/current").get_json()
    assert current["session_id"] == "default" and len(current["slots"]) == 2


def test_a_base_snapshot_is_made_and_restored_in_the_slot_the_session_runs_in(mock, tmp_path):
    """Slot 0 stays busy throughout: the base of slot 1's system prompt is prefilled, saved and
    later restored in slot 1, and recorded so."""
    from kvproxy.sessions.identity import base_stem
    from kvproxy.slots.switch import BASE
    from tests.fake_llama import FakePrompt
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path, base_snapshots=True, lock_timeout=1)
    store = SessionStore(tmp_path)
    busy = switch.acquire(A)
    prompt = FakePrompt(range(110), list(range(100)))
    computed = metric("kvproxy_prompt_tokens_total", kind="computed")
    first = switch.acquire(Session("B", "test", system_hash="bbbb", model=MODEL), prompt=prompt)
    assert first.slot == 1 and fake.pinned == [1], "the prefill runs in the session's slot"
    base = store.read_sidecar(base_stem("bbbb", MODEL))
    assert (base["saved_from_slot"], base["n_tokens"], base["prefill_computed"]) == (1, 100, 100)
    assert metric("kvproxy_prompt_tokens_total", kind="computed") == computed + 100
    switch.release(first, {"cache_n": 100, "prompt_n": 9, "predicted_n": 1})
    second = switch.acquire(Session("C", "test", system_hash="bbbb", model=MODEL), prompt=prompt)
    assert (second.slot, second.cache, second.restored_tokens) == (1, BASE, 100)
    assert ("restore", f"{base_stem('bbbb', MODEL)}.bin") in actions_on(fake, 1)
    assert actions_on(fake, 0) == [("erase", None)], "the busy slot was never touched"
    switch.release(second)  # the restore is recorded with the request, after its answer
    restored = store.read_sidecar(base_stem("bbbb", MODEL))
    assert restored["restored_into_slot"] == 1 and restored["last_used_at"] >= base["saved_at"]
    assert restored["restores"] == 1
    switch.release(busy)


def test_a_repeated_hit_writes_the_state_table_at_most_once_a_second(mock, tmp_path, monkeypatch):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path)
    answer(switch, A, fake)
    writes = []
    original = switch.store.change_table
    monkeypatch.setattr(switch.store, "change_table",
                        lambda change: writes.append(1) or original(change))
    for _ in range(5):
        assert answer(switch, A, fake).cache == HIT
    assert len(writes) <= 1, "the no-swap path wrote the table on every request"
    monkeypatch.setattr("kvproxy.slots.plan.USED_AT_RESOLUTION_S", 0.0)
    answer(switch, A, fake)
    assert len(writes) >= 1 and json.loads((tmp_path / STATE_FILE).read_text())["slots"]["0"]


def test_this_process_s_own_use_orders_the_slots_before_the_table_shows_it():
    from kvproxy.slots.placement import facts_from_table
    table = {0: {"active": "A", "active_key": "a", "active_persistent": True,
                 "used_at": "2026-01-01T00:00:02.000+00:00"},
             1: {"active": "B", "active_key": "b", "active_persistent": True,
                 "used_at": "2026-01-01T00:00:03.000+00:00"}}
    facts = facts_from_table(typed(table), [0, 1], [], {0: "2026-01-01T00:00:04.000+00:00",
                                                 1: "2026-01-01T00:00:01.000+00:00"})
    assert [f.used_at[17:19] for f in facts] == ["04", "03"]


def test_a_file_whose_session_another_slot_holds_is_never_evicted(mock, tmp_path):
    """Even when it is the least recently used file: the slot may be saved over it, but
    evicting it would lose the session's way back should that slot be lost."""
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path, max_disk_bytes=40)      # room for two 16-byte files
    answer(switch, B, fake, tokens=12)                      # slot 0
    answer(switch, A, fake, tokens=12)                      # slot 1
    answer(switch, C, fake, tokens=12)                      # slot 0: B saved
    held_b = answer(switch, B, fake, tokens=12)             # slot 1: A saved, B restored
    assert held_b.cache == RESTORED
    store = SessionStore(tmp_path)
    store.update_sidecar(B.stem, {}, last_used_at="2000-01-01T00:00:00+00:00")
    answer(switch, Session("D", "test", model=MODEL), fake, tokens=12)   # slot 0: saving C needs room
    assert (tmp_path / f"{B.stem}.bin").exists(), "the file of the session slot 1 holds"
    assert not (tmp_path / f"{A.stem}.bin").exists(), "the least recently used of the rest"
    assert (tmp_path / f"{C.stem}.bin").exists()


def test_forget_empties_the_slot_holding_the_session_and_leaves_the_others_alone(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path)
    assert answer(switch, B, fake).slot == 0
    assert answer(switch, A, fake, tokens=30).slot == 1      # not the first slot
    assert switch.forget("A") is True
    assert fake.held == [20, 0]
    assert [(row["session_id"], row["unproven"]) for row in switch.slot_listing()] == \
        [("B", False), ("default", False)]
    lease = switch.acquire(A)
    switch.release(lease)
    assert lease.cache == MISS, "nothing of a forgotten session is served again"
    lease = switch.acquire(B)
    switch.release(lease)
    assert (lease.slot, lease.cache) == (0, HIT)


def test_forget_does_not_wait_for_a_slot_busy_with_another_session(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path, lock_timeout=0.5)
    assert answer(switch, A, fake).slot == 0
    busy = switch.acquire(B)
    try:
        assert switch.forget("A") is True
        assert fake.held[0] == 0
    finally:
        switch.release(busy)


def test_forget_empties_every_slot_of_the_id_when_one_changed_hands_first(mock, tmp_path,
                                                                          monkeypatch):
    """One id in two slots (two system prompts); another process swaps the first slot to
    another session just before forget gets to it: the second slot is emptied all the same."""
    fake = fake_with(mock, tmp_path, 2)
    switch, other = switch_over(tmp_path), switch_over(tmp_path)
    first = Session("A", "test", system_hash="aaaa", key="A#aaaa", model=MODEL)
    second = Session("A", "test", system_hash="cccc", key="A#cccc", model=MODEL)
    assert answer(switch, first, fake).slot == 0
    assert answer(switch, second, fake, tokens=30).slot == 1
    lock = switch.pool.lock(0)
    take = lock.acquire

    def other_process_first(*args, **kwargs):
        monkeypatch.setattr(lock, "acquire", take)
        assert answer(other, C, fake).slot == 0
        return take(*args, **kwargs)
    monkeypatch.setattr(lock, "acquire", other_process_first)
    assert switch.forget("A") is True
    assert fake.held == [20, 0] and not list(tmp_path.glob("A-*"))
    assert [row["session_id"] for row in switch.slot_listing()] == ["C", "default"]
    lease = switch.acquire(second)
    switch.release(lease)
    assert lease.cache == MISS


def test_the_save_at_shutdown_waits_for_busy_slots_within_one_bound_for_all(mock, tmp_path):
    fake_with(mock, tmp_path, 5)
    switch = switch_over(tmp_path)
    leases = [switch.acquire(Session(f"s{n}", "test", model=MODEL)) for n in range(5)]
    assert sorted(lease.slot for lease in leases) == [0, 1, 2, 3, 4]
    started = time.monotonic()
    try:
        assert switch.checkpoint(timeout=0.2) is False
        waited = time.monotonic() - started
    finally:
        for lease in leases:
            switch.release(lease)
    assert waited < 2.5, "the bound covers every slot together, not each slot"


def test_swaps_are_counted_by_slot_and_kind(mock, tmp_path):
    def counts():
        return {(slot, kind): metric("kvproxy_slot_swaps_total", slot=slot, kind=kind)
                for slot in ("0", "1") for kind in ("none", "save", "restored", "base", "miss")}
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path)
    none_before = metric("kvproxy_swaps_total", kind="none")
    before = counts()
    answer(switch, A, fake)                  # slot 0: miss
    answer(switch, B, fake)                  # slot 1: miss
    time.sleep(0.01)
    answer(switch, A, fake)                  # slot 0: the slot holds it
    answer(switch, C, fake)                  # slot 1, least recently used: B saved, C new
    answer(switch, B, fake)                  # slot 0: A saved, B restored
    grew = {key: value - before[key] for key, value in counts().items() if value != before[key]}
    assert grew == {("0", "miss"): 1, ("0", "none"): 1, ("0", "save"): 1, ("0", "restored"): 1,
                    ("1", "miss"): 2, ("1", "save"): 1}
    assert metric("kvproxy_swaps_total", kind="none") == none_before + 1


def test_a_session_being_swapped_in_by_one_process_is_not_claimed_by_another(mock, tmp_path):
    fake_with(mock, tmp_path, 2)
    first, second = switch_over(tmp_path), switch_over(tmp_path)
    first.executor.claim(0, A, [0, 1])  # first is restoring A into slot 0 right now
    from kvproxy.slots.executor import HeldElsewhere
    with pytest.raises(HeldElsewhere):
        second.swaps.swap_to(A, None, 1)
    assert SessionStore(tmp_path).read_table()[0]["active_key"] == A.key


def test_a_slot_being_filled_is_listed_with_its_session_unproven(mock, tmp_path):
    """While a swap fills a slot (and after one that failed half-way), another process lists
    the session it is being filled with: persistent, no tokens vouched for, unproven, and
    since and last used when the swap began."""
    fake_with(mock, tmp_path, 2)
    first, second = switch_over(tmp_path), switch_over(tmp_path)
    before = now_iso()
    first.executor.claim(1, A, [0, 1])  # first is restoring A into slot 1 right now
    row = second.slot_listing()[1]
    assert (row["session_id"], row["persistent"], row["file"]) == ("A", True, f"{A.stem}.bin")
    assert row["tokens"] == 0 and row["unproven"]
    assert row["since"] >= before and row["last_used_at"] >= before


def test_the_file_a_slot_is_being_filled_from_is_not_evicted_by_another_process(mock,
                                                                               tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    first, second = switch_over(tmp_path, max_disk_bytes=40), switch_over(tmp_path,
                                                                          max_disk_bytes=40)
    answer(first, A, fake, tokens=12)        # slot 0
    answer(first, B, fake, tokens=12)        # slot 1
    answer(first, C, fake, tokens=12)        # slot 0: A saved (16 bytes)
    answer(first, Session("D", "test", model=MODEL), fake, tokens=12)        # slot 1: B saved (32)
    SessionStore(tmp_path).update_sidecar(A.stem, {}, last_used_at="2000-01-01T00:00:00+00:00")
    restoring = first.pool.lock(0)
    restoring.acquire()   # first is about to restore A into slot 0: it holds the slot
    try:
        first.executor.claim(0, A, [0, 1])
        answer(second, Session("E", "test", model=MODEL), fake, tokens=12)   # slot 1: saving D needs room
    finally:
        restoring.release()
    assert (tmp_path / f"{A.stem}.bin").exists(), "the file being restored"
    assert not (tmp_path / f"{B.stem}.bin").exists()


def test_with_one_llama_server_slot_kvproxy_keeps_driving_its_configured_slot(mock, tmp_path):
    """Asked or not, a single slot is KVPROXY_SLOT_ID: the slot it drove before llama-server
    answered stays the one it drives after."""
    fake_with(mock, tmp_path, 1)
    assert switch_over(tmp_path, slot_id=2).slot_ids() == [2]


def test_another_process_evicts_the_slot_used_least_recently_by_any_process(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 2)
    first = switch_over(tmp_path)
    slot_a = answer(first, A, fake).slot
    time.sleep(0.01)
    slot_b = answer(first, B, fake).slot
    time.sleep(0.01)
    assert answer(first, A, fake, tokens=30).cache == HIT   # B is now the least recently used
    second = switch_over(tmp_path)
    lease = second.acquire(C)
    assert lease.slot == slot_b and lease.slot != slot_a
    second.release(lease)


def test_with_one_slot_a_request_that_changes_nothing_leaves_the_state_file_alone(mock, tmp_path):
    """used_at orders slots for eviction only with several slots: one slot never writes it
    alone, not even in a process that has not written it yet."""
    fake = fake_with(mock, tmp_path, 1)
    answer(switch_over(tmp_path), A, fake)
    before = (tmp_path / STATE_FILE).read_text()
    other = switch_over(tmp_path)                # a process that has written nothing yet
    assert answer(other, A, fake).cache == HIT
    assert (tmp_path / STATE_FILE).read_text() == before


def test_a_slot_just_swapped_lists_when_it_was_last_used(mock, tmp_path):
    fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path)
    lease = switch.acquire(A)
    row = [r for r in switch.slot_listing() if r["id"] == lease.slot][0]
    assert row["session_id"] == "A" and row["last_used_at"]
    switch.release(lease)


def test_a_state_file_lost_during_a_request_gets_the_slot_s_entry_back(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 1)
    switch = switch_over(tmp_path)
    lease = switch.acquire(A)
    (tmp_path / STATE_FILE).unlink()
    fake.held[lease.slot] = 20
    switch.release(lease, {"cache_n": 0, "prompt_n": 19, "predicted_n": 1})
    assert SessionStore(tmp_path).read_state(lease.slot)["slot_tokens"] == 20


def test_the_swap_time_is_reported_in_milliseconds(mock, tmp_path):
    fake = fake_with(mock, tmp_path, 1)
    switch = switch_over(tmp_path)
    answer(switch, A, fake)
    fake.on_save = lambda name: time.sleep(0.05)
    started = time.monotonic()
    lease = switch.acquire(B)                    # saves A first: at least 50 ms
    elapsed_ms = (time.monotonic() - started) * 1000
    switch.release(lease)
    assert 50 <= lease.swap_ms <= elapsed_ms


def test_an_answered_request_stamps_its_session_s_last_use(mock, tmp_path):
    """The sidecar's last use orders files for eviction from the disk: a hit counts too."""
    fake = fake_with(mock, tmp_path, 1)
    switch = switch_over(tmp_path)
    store = switch.store
    answer(switch, A, fake)
    first = store.read_sidecar(A.stem)["last_used_at"]
    time.sleep(0.01)
    assert answer(switch, A, fake).cache == HIT
    assert store.read_sidecar(A.stem)["last_used_at"] > first


def test_a_fresh_chat_that_made_a_base_snapshot_is_not_judged_as_a_restore(mock, tmp_path):
    """Only a restore is checked against the tokens llama-server reused afterwards: a fresh
    chat whose prefill llama-server reused neither clears nor adds to the misses in a row."""
    from kvproxy.slots.switch import fingerprint_key
    from tests.fake_llama import FakePrompt
    fake_with(mock, tmp_path, 1)
    switch = switch_over(tmp_path, base_snapshots=True)
    key = fingerprint_key(switch.current_made_by())
    switch.restore_check.record(key, False)      # one unhonoured restore before
    lease = switch.acquire(Session("B", "test", system_hash="bbbb", model=MODEL),
                           prompt=FakePrompt(range(110), list(range(100))))
    assert lease.cache == MISS and lease.restored_tokens == 100
    switch.release(lease, {"cache_n": 100, "prompt_n": 10, "predicted_n": 1})
    assert switch.restore_check.entries()[key]["misses"] == 1


def typed(table: dict) -> dict:
    """A state table written as entries of the state file, as typed slot states."""
    return {slot: SlotState.from_entry(entry) for slot, entry in table.items()}


def test_the_swap_log_says_why_the_slot_was_chosen(mock, tmp_path, caplog):
    fake = fake_with(mock, tmp_path, 2)
    switch = switch_over(tmp_path)
    with caplog.at_level("INFO", logger="kvproxy.switch"):
        for session in (A, B, C, B):
            answer(switch, session, fake)
    assert re.findall(r"placed=(\w+)", caplog.text) == ["free", "free", "evict"], \
        "A and B in the empty slots, C in the least recently used; B again is a hit"
