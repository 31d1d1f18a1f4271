"""The slot pool alone: its time bound, the Retry-After it advises, side requests in parallel."""
import time

import pytest

from kvproxy.telemetry import metrics
from kvproxy.sessions.identity import Session
from kvproxy.slots.lock import SlotBusy
from kvproxy.slots.pool import SlotPool
from kvproxy.slots.queue import MAX_OVERTAKEN, Waiter
from kvproxy.storage.store import SessionStore
from tests.fake_llama import make_switch


@pytest.mark.parametrize("bound, advised", [(0.3, 1), (7, 7), (120, 30)])
def test_a_full_queue_advises_retrying_after_the_bound_kept_within_1_to_30_s(
        tmp_path, bound, advised):
    pool = SlotPool(SessionStore(tmp_path), timeout=300, max_waiters=0)
    held = pool.take([0], "A", False).slot
    refused = rejected("queue_full")
    try:
        with pytest.raises(SlotBusy) as busy:
            pool.take([0], "B", False, timeout=bound)   # the caller's bound, not the pool's
        assert busy.value.retry_after == advised
    finally:
        pool.give_back(held)
    assert rejected("queue_full") == refused + 1


def test_without_a_bound_of_its_own_a_request_waits_as_long_as_the_pool_says(tmp_path):
    pool = SlotPool(SessionStore(tmp_path), timeout=0.3, max_waiters=4)
    waits = metrics.REGISTRY.get_sample_value("kvproxy_lock_wait_seconds_sum") or 0
    held = pool.take([0], "A", False).slot
    assert 0 <= metrics.REGISTRY.get_sample_value("kvproxy_lock_wait_seconds_sum") - waits < 1
    timed_out = rejected("timeout")
    started = time.monotonic()
    try:
        with pytest.raises(SlotBusy):
            pool.take([0], "B", False)
    finally:
        pool.give_back(held)
    assert 0.25 < time.monotonic() - started < 3
    assert rejected("timeout") == timed_out + 1


def rejected(reason):
    return metrics.REGISTRY.get_sample_value("kvproxy_slot_rejected_total", {"reason": reason}) or 0


def test_two_side_requests_run_at_once_in_two_slots(tmp_path, fake):
    """Side requests hold nothing worth keeping: the second never waits for the first's slot,
    although the table names the same key in it."""
    switch = make_switch(tmp_path, slots=2, lock_timeout=1)
    side = Session("side", "side-request", persistent=False)
    first = switch.acquire(side)
    second = switch.acquire(side)
    assert {first.slot, second.slot} == {0, 1}
    switch.release(second)
    switch.release(first)


def test_a_slot_s_last_use_in_this_process_never_goes_back(tmp_path):
    """Two requests' bookkeeping can finish out of order: the later use wins either way."""
    pool = SlotPool(SessionStore(tmp_path), timeout=1, max_waiters=4)
    pool.note_use(1, "2026-01-01T10:00:02+00:00")
    pool.note_use(1, "2026-01-01T10:00:01+00:00")
    pool.note_use(0, "2026-01-01T09:00:00+00:00")
    assert pool.used_here == {1: "2026-01-01T10:00:02+00:00", 0: "2026-01-01T09:00:00+00:00"}


def test_a_returning_conversation_waits_ahead_of_new_ones_overtaken_less_than_the_limit():
    from kvproxy.slots.pool import queue_position

    def waiter(short, overtaken=0):
        w = Waiter("k", False, short)
        w.overtaken = overtaken
        return w
    queue = [waiter(False), waiter(True), waiter(False), waiter(False)]
    assert queue_position(queue, short=True) == 2, "before the new ones behind a short one"
    assert [w.overtaken for w in queue] == [0, 0, 1, 1], "each counts being overtaken"
    assert queue_position(queue, short=False) == 4, "new ones keep arrival order"
    worn = [waiter(False, MAX_OVERTAKEN), waiter(False, MAX_OVERTAKEN - 1)]
    assert queue_position(worn, short=True) == 1, "one overtaken often enough keeps its place"
    assert worn[1].overtaken == MAX_OVERTAKEN
    assert queue_position(worn, short=True) == 2
    assert queue_position([], short=True) == 0


def test_a_returning_conversation_is_served_before_a_new_one_that_came_first(tmp_path):
    import threading
    pool = SlotPool(SessionStore(tmp_path), timeout=10, max_waiters=4)
    held = pool.take([0], "A", False).slot
    served = []

    def wait(key, short):
        taken = pool.take([0], key, False, short=lambda: short)
        served.append(key)
        pool.give_back(taken.slot)
    new = threading.Thread(target=wait, args=("new", False))
    new.start()
    time.sleep(0.2)
    returning = threading.Thread(target=wait, args=("returning", True))
    returning.start()
    time.sleep(0.2)
    pool.give_back(held)
    new.join(5)
    returning.join(5)
    assert served == ["returning", "new"]


def test_the_switch_counts_a_conversation_with_a_file_on_its_model_as_returning(tmp_path, fake):
    from tests.fake_llama import MODEL
    switch = make_switch(tmp_path)
    a = Session("A", "test")  # as a request names it: no model yet
    assert not switch.requests.returning(a)
    lease = switch.acquire(a)
    fake.tokens = 40
    switch.release(lease, {"cache_n": 0, "prompt_n": 40, "predicted_n": 0})
    assert switch.requests.returning(a), "in the slot"
    switch.save_settled(0)
    switch.release(switch.acquire(Session("B", "test")))  # evicts A: on disk only now
    assert switch.store.has_bin(a.on_model(MODEL).stem)
    assert switch.requests.returning(a)
    assert not switch.requests.returning(Session("C", "test")), "a new conversation"
    assert not switch.requests.returning(Session("side", "side-request", persistent=False))


def waiting_new_conversation(pool, taken_at, slot_ids=(0,)):
    """A thread taking a slot for a new conversation; notes when it got one, and which."""
    import threading

    def new_conversation():
        taken = pool.take(list(slot_ids), "new", False, short=lambda: False)
        taken_at["new"], taken_at["slot"] = time.monotonic(), taken.slot
        pool.give_back(taken.slot)
    thread = threading.Thread(target=new_conversation, daemon=True)
    thread.start()
    time.sleep(0.2)
    return thread


def test_a_slot_is_kept_for_its_conversation_s_next_turn_while_a_new_one_waits(tmp_path):
    pool = SlotPool(SessionStore(tmp_path), timeout=10, max_waiters=4, keep=0.6)
    first = pool.take([0], "A", False)
    taken_at = {}
    waiter = waiting_new_conversation(pool, taken_at)
    started = time.monotonic()
    pool.give_back(first.slot, keep_for="A")                           # A's first turn ends
    time.sleep(0.2)
    assert "new" not in taken_at, "the slot is kept for A"
    again = pool.take([0], "A", False)                                 # A answers at once
    assert again.placed == "holder" and time.monotonic() - started < 0.5
    assert pool._queue[0].overtaken == 1, "A went before the waiting new conversation"
    pool.give_back(again.slot, keep_for="A")
    waiter.join(5)
    assert taken_at["new"] - started >= 0.6, "kept again after A's second turn"
    assert taken_at["new"] - started < 3, "then the keep ran out"


def test_with_nobody_waiting_a_slot_is_not_kept(tmp_path):
    pool = SlotPool(SessionStore(tmp_path), timeout=10, max_waiters=4, keep=5)
    pool.give_back(pool.take([0], "A", False).slot, keep_for="A")
    started = time.monotonic()
    pool.give_back(pool.take([0], "new", False, short=lambda: False).slot)
    assert time.monotonic() - started < 1, "a new conversation that comes later takes it"


def test_a_returning_conversation_or_one_passed_over_enough_may_take_a_kept_slot(tmp_path):
    pool = SlotPool(SessionStore(tmp_path), timeout=10, max_waiters=4, keep=5)
    first = pool.take([0], "A", False)
    taken_at = {}
    waiter = waiting_new_conversation(pool, taken_at)
    pool.give_back(first.slot, keep_for="A")
    started = time.monotonic()
    taken = pool.take([0], "B", False, short=lambda: True)   # B has a file: a short turn
    assert time.monotonic() - started < 1, "no wait for A's keep"
    assert "new" not in taken_at
    pool.give_back(taken.slot)
    waiter.join(5)
    assert "new" in taken_at
    passed_over = Waiter("C", False)
    passed_over.overtaken = MAX_OVERTAKEN
    assert not passed_over.honours_keeps() and Waiter("C", False).honours_keeps()
    assert not Waiter("x", True).honours_keeps(), "side requests are short"


def test_a_keep_never_makes_a_new_conversation_time_out(tmp_path):
    pool = SlotPool(SessionStore(tmp_path), timeout=1, max_waiters=4, keep=30)
    first = pool.take([0], "A", False)
    taken_at = {}
    waiter = waiting_new_conversation(pool, taken_at)        # it may wait 1 s, the keep is 30
    started = time.monotonic()
    pool.give_back(first.slot, keep_for="A")
    waiter.join(5)
    assert taken_at["new"] - started < 0.5, "the new conversation took the slot, no 503"
    assert Waiter("C", False, deadline=10).honours_keeps(9.9)
    assert not Waiter("C", False, deadline=10).honours_keeps(10.1)


def test_one_slot_of_several_is_never_kept_so_new_conversations_keep_moving(tmp_path):
    pool = SlotPool(SessionStore(tmp_path), timeout=10, max_waiters=4, keep=5)
    a, b = pool.take([0, 1], "A", False), pool.take([0, 1], "B", False)
    got = {}
    waiter = waiting_new_conversation(pool, got, [0, 1])
    pool.give_back(a.slot, keep_for="A")
    time.sleep(0.2)
    assert "new" not in got, "A's slot is kept for A"
    pool.give_back(b.slot, keep_for="B")
    waiter.join(2)
    assert got["slot"] == b.slot, "the last slot is not kept: the new conversation runs"


def persistent_slots(pool, *keys):
    """The state table names a persistent session per slot, the first used longest ago."""
    from kvproxy.slots.state import Phase, SlotState
    for slot, key in enumerate(keys):
        pool.table.put(slot, SlotState(Phase.OURS, session_id=key, key=key, persistent=True))
        pool.note_use(slot, f"2026-01-01T00:00:0{slot}")


def test_keeps_end_once_no_new_conversation_waits(tmp_path):
    pool = SlotPool(SessionStore(tmp_path), timeout=10, max_waiters=4, keep=5)
    a, b = pool.take([0, 1], "A", False), pool.take([0, 1], "B", False)
    got = {}
    waiter = waiting_new_conversation(pool, got, [0, 1])
    pool.give_back(a.slot, keep_for="A")       # kept: a new conversation waits
    pool.give_back(b.slot, keep_for="B")       # not kept: it takes this one and leaves
    waiter.join(2)
    assert got["slot"] == b.slot
    started = time.monotonic()
    later = pool.take([0, 1], "C", False)
    assert later.slot == a.slot and time.monotonic() - started < 1, \
        "nobody waits any more: A's slot is not kept from a later request"


def test_a_request_waits_for_a_background_save_rather_than_evict_a_newer_session(tmp_path):
    import threading
    pool = SlotPool(SessionStore(tmp_path), timeout=10, max_waiters=4)
    persistent_slots(pool, "A", "B")            # A, in slot 0, was used longest ago
    assert pool.hold_for_save(0)
    got = {}
    request = threading.Thread(target=lambda: got.update(z=pool.take([0, 1], "Z", False)),
                               daemon=True)
    request.start()
    time.sleep(0.3)
    assert "z" not in got, "B, used later and unsaved, is not evicted meanwhile"
    pool.give_back(0)                           # the save is done
    request.join(2)
    assert got["z"] == (0, True, "evict")
    assert not pool.hold_for_save(0), "a slot a request holds is not saved behind"


def test_with_several_slots_one_keeps_taking_new_conversations(tmp_path):
    import threading
    pool = SlotPool(SessionStore(tmp_path), timeout=10, max_waiters=8)
    a, b = pool.take([0, 1], "A", False), pool.take([0, 1], "B", False)
    served, taken = [], {}

    def wait(key, short):
        taken[key] = pool.take([0, 1], key, False, short=lambda: short)
        served.append(key)
    threads = []
    for key, short in (("returning-1", True), ("new-1", False), ("returning-2", True),
                       ("new-2", False)):
        threads.append(threading.Thread(target=wait, args=(key, short), daemon=True))
        threads[-1].start()
        time.sleep(0.15)
    pool.give_back(a.slot)
    time.sleep(0.3)
    assert served == ["new-1"], "no slot runs a new conversation: the first one goes first"
    pool.give_back(b.slot)
    time.sleep(0.3)
    assert served == ["new-1", "returning-1"], "one does: returning turns take the others"
    pool.give_back(taken["returning-1"].slot)
    time.sleep(0.3)
    assert served == ["new-1", "returning-1", "returning-2"]
    pool.give_back(taken["new-1"].slot)
    for thread in threads:
        thread.join(2)
    assert served[-1] == "new-2"


def test_overtaking_is_not_counted_while_a_slot_serves_new_conversations(tmp_path):
    import threading
    from kvproxy.slots.pool import queue_position
    queue = [Waiter("n1", False), Waiter("n2", False)]
    assert queue_position(queue, True, counts=False) == 0
    assert [w.overtaken for w in queue] == [0, 0]
    pool = SlotPool(SessionStore(tmp_path), timeout=10, max_waiters=8)
    a, b = pool.take([0, 1], "A", False), pool.take([0, 1], "B", False)
    taken = {}

    def wait(key, short):
        taken[key] = pool.take([0, 1], key, False, short=lambda: short)
    for key, short in (("new-1", False), ("new-2", False), ("returning", True)):
        threading.Thread(target=wait, args=(key, short), daemon=True).start()
        time.sleep(0.15)
        if key == "new-1":
            pool.give_back(a.slot)                 # new-1 takes it: a slot serves new ones
            time.sleep(0.15)
    assert "new-1" in taken
    assert [(w.key, w.overtaken) for w in pool._queue] == [("returning", 0), ("new-2", 0)]
    pool.give_back(b.slot)
    time.sleep(0.3)
    assert "returning" in taken and "new-2" not in taken
    pool.give_back(taken["new-1"].slot)
    pool.give_back(taken["returning"].slot)
