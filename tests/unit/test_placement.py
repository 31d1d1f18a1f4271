"""Where a request runs with several slots: the pure placement decision, table-driven."""
import pytest

from kvproxy.slots.state import Phase, SlotState
from kvproxy.slots.placement import (EVICT, FREE, HOLDER, WAIT, Placement, SlotFacts, facts_from_table,
                               place, queue_order)


def slots(*specs):
    """``"A"``: idle slot holding persistent session A; ``"A*"``: the same, busy; ``"-"``: empty;
    ``"side"``: holds a side request; used_at is the position unless a spec sets it."""
    out = []
    for i, spec in enumerate(specs):
        used = f"2026-01-01T00:00:0{i}"
        if isinstance(spec, tuple):
            spec, used = spec
        busy = spec.endswith("*")
        name = spec.rstrip("*")
        if name == "-":
            out.append(SlotFacts(i, None, False, used, busy))
        elif name == "side":
            out.append(SlotFacts(i, "side", False, used, busy))
        else:
            out.append(SlotFacts(i, name, True, used, busy))
    return out


@pytest.mark.parametrize("table, key, side, expected", [
    # the slot that holds the session, idle: a hit, wherever it is
    (("A", "B"), "B", False, Placement(HOLDER, 1)),
    (("A*", "B"), "B", False, Placement(HOLDER, 1)),
    # the slot that holds it is busy: wait for it, never a second copy elsewhere
    (("A", "B*", "-"), "B", False, Placement(WAIT)),
    # an empty idle slot before any slot whose session would need saving
    (("A", "-", "B"), "C", False, Placement(FREE, 1)),
    (("A*", "-"), "C", False, Placement(FREE, 1)),
    # a slot holding a side request's leftovers costs nothing either
    (("A", "side"), "C", False, Placement(FREE, 1)),
    # the lowest free id first
    (("A", "-", "-"), "C", False, Placement(FREE, 1)),
    # no free slot: the least recently used idle one, saved first
    ((("A", "2026-01-01T00:00:09"), ("B", "2026-01-01T00:00:01"), "C"), "D", False,
     Placement(EVICT, 1)),
    (("A", "B*"), "C", False, Placement(EVICT, 0)),
    # busy slots are never chosen, however old
    ((("A*", "2000-01-01T00:00:00"), "B"), "C", False, Placement(EVICT, 1)),
    # all busy: wait
    (("A*", "B*"), "C", False, Placement(WAIT)),
    (("-*",), "C", False, Placement(WAIT)),
    # side requests: an empty slot first, never a conversation's slot while one is free
    (("A*", "-"), "side", True, Placement(FREE, 1)),
    (("A", "B", "-"), "side", True, Placement(FREE, 2)),
    # ... else the LRU idle slot, whose conversation is saved first
    (("A*", "B"), "side", True, Placement(EVICT, 1)),
    (("A*", "B*"), "side", True, Placement(WAIT)),
    # a side request is not bound to the slot another side request left (runs in parallel)
    (("side*", "-"), "side", True, Placement(FREE, 1)),
    # one slot behaves as kvproxy always did
    (("A",), "A", False, Placement(HOLDER, 0)),
    (("A",), "B", False, Placement(EVICT, 0)),
    (("A*",), "B", False, Placement(WAIT)),
    (("-",), "B", False, Placement(FREE, 0)),
])
def test_place(table, key, side, expected):
    assert place(slots(*table), key, side) == expected


def test_waiters_are_served_first_come_first_served():
    view = slots("A*", "-", "B")
    waiting = [("C", False, True), ("D", False, True), ("E", False, True)]
    assert queue_order(view, waiting, 0) == Placement(FREE, 1)
    assert queue_order(view, waiting, 1) == Placement(EVICT, 2)
    assert queue_order(view, waiting, 2) == Placement(WAIT)


def test_a_waiter_for_its_busy_holder_does_not_block_the_ones_behind_it():
    view = slots("A*", "-")
    waiting = [("A", False, False), ("C", False, True)]
    assert queue_order(view, waiting, 0) == Placement(WAIT)
    assert queue_order(view, waiting, 1) == Placement(FREE, 1)


def test_facts_from_the_state_table():
    table = {0: {"active": "A", "active_key": "kA", "active_persistent": True,
                 "used_at": "t1"},
             1: {"active": "default", "active_key": "default", "active_persistent": False},
             3: {"active": "Z", "active_key": "kZ", "active_persistent": True}}
    facts = facts_from_table(typed(table), [0, 1, 2], busy={1})
    assert facts == [SlotFacts(0, "kA", True, "t1", False),
                     SlotFacts(1, "default", False, "", True),
                     SlotFacts(2, None, False, "", False)]  # slot 3 is not driven


def test_two_waiters_for_one_session_never_get_two_slots():
    view = slots("A", "-")
    waiting = [("A", False, False), ("A", False, False)]
    assert queue_order(view, waiting, 0) == Placement(HOLDER, 0)
    assert queue_order(view, waiting, 1) == Placement(WAIT), "A would run in two slots at once"


def test_a_request_is_a_conversation_unless_it_says_it_is_a_side_request():
    assert place(slots("A", "B"), "B") == Placement(HOLDER, 1)


def test_an_entry_without_a_use_time_is_ordered_by_when_it_was_filled():
    """Entries written before slots had a use time: the older fill is evicted first."""
    table = {0: {"active": "A", "active_key": "kA", "active_persistent": True,
                 "updated_at": "2026-01-02T00:00:00"},
             1: {"active": "B", "active_key": "kB", "active_persistent": True,
                 "updated_at": "2026-01-01T00:00:00"}}
    assert place(facts_from_table(typed(table), [0, 1], busy=()), "kC") == \
        Placement(EVICT, 1)


def test_an_entry_naming_no_active_session_holds_nothing():
    facts = facts_from_table(typed({0: {"active_key": "kA", "active_persistent": True}}), [0],
                            busy=())
    assert facts == [SlotFacts(0, None, False, "", False)]


def typed(table: dict) -> dict:
    """A state table written as entries of the state file, as typed slot states."""
    return {slot: SlotState.from_entry(entry) for slot, entry in table.items()}


def kept(view, slot, key):
    return [SlotFacts(s.id, s.key, s.persistent, s.used_at, s.busy, key) if s.id == slot else s
            for s in view]


def test_a_slot_kept_for_its_conversation_is_left_alone_by_new_conversations_only():
    view = kept(slots("A", "B*"), 0, "A")
    assert place(view, "C", honours_keeps=True) == Placement(WAIT), "a new one waits"
    assert place(view, "C", honours_keeps=False) == Placement(EVICT, 0), "a returning one may"
    assert place(view, "x", side=True) == Placement(EVICT, 0), "so may a side request"
    assert place(view, "A", honours_keeps=False) == Placement(HOLDER, 0)
    assert place(kept(slots("A", "-"), 0, "A"), "C", honours_keeps=True) == Placement(FREE, 1), \
        "a new one takes another idle slot"


def test_the_kept_conversation_goes_before_a_new_one_queued_ahead_of_it():
    view = kept(slots("A"), 0, "A")
    waiting = [("C", False, True), ("A", False, False)]
    assert queue_order(view, waiting, 0) == Placement(WAIT)
    assert queue_order(view, waiting, 1) == Placement(HOLDER, 0)


def test_a_keep_ends_when_the_table_shows_another_session_in_the_slot():
    table = {0: SlotState(Phase.OURS, session_id="B", key="kB", persistent=True),
             1: SlotState(Phase.OURS, session_id="A", key="kA", persistent=True)}
    facts = facts_from_table(table, [0, 1], [], None, {0: "kA", 1: "kA"})
    assert [f.kept_for for f in facts] == [None, "kA"]
    assert facts_from_table({}, [0], [], None, {0: "kA"})[0].kept_for == "kA", \
        "one slot: the table is not read, the keep stands"


def saving(view, slot):
    """``view`` with ``slot`` busy with a background save."""
    return [SlotFacts(s.id, s.key, s.persistent, s.used_at, True, s.kept_for, True)
            if s.id == slot else s for s in view]


def test_a_slot_being_saved_behind_is_waited_for_when_it_is_the_one_to_evict():
    assert place(saving(slots("A", "B"), 0), "C") == Placement(WAIT), \
        "A is saved in a moment: evicting B would save B first"
    assert place(saving(slots("A", "B"), 1), "C") == Placement(EVICT, 0), "A is still older"
    assert place(saving(slots("A", "-"), 0), "C") == Placement(FREE, 1), "an empty slot first"
    assert place(saving(slots("A", "B"), 0), "A") == Placement(WAIT), "its own session waits"
    facts = facts_from_table({}, [0, 1], [0], None, None, saving=[0])
    assert [(f.busy, f.saving) for f in facts] == [(True, True), (False, False)]
