"""``bench.overhead --without``: the parts it cuts repeat the first request's result, the
first one done for real (a slot's lease taken and freed once), and its names are checked."""
from __future__ import annotations

import argparse

import pytest

from bench import overhead, overhead_without


class Relay:
    def __init__(self):
        self.resolved = 0

    def session_for(self, call, stream, switch=None):
        self.resolved += 1
        return ("session", call, self.resolved)


class Switch:
    def __init__(self):
        self.taken, self.freed = [], []

    def acquire(self, session, *, still_wanted=None, prompt=None):
        self.taken.append(session)
        return ("lease", len(self.taken))

    def release(self, lease, timings=None):
        self.freed.append(lease)


def fresh(cls):
    return type(cls.__name__, (cls,), {})


def test_without_the_session_every_request_gets_the_first_ones():
    relay_class, switch_class = fresh(Relay), fresh(Switch)
    overhead_without.cut({"session"}, relay_class, switch_class)
    relay = relay_class()
    assert relay.session_for("a", False) == ("session", "a", 1)
    assert relay.session_for("b", True) == ("session", "a", 1)
    assert relay.resolved == 1
    switch = switch_class()
    assert switch.acquire("s") != switch.acquire("s")   # the slot is untouched


def test_without_the_slot_the_first_lease_is_taken_freed_and_reused():
    relay_class, switch_class = fresh(Relay), fresh(Switch)
    overhead_without.cut({"slot"}, relay_class, switch_class)
    switch = switch_class()
    lease = switch.acquire("one", prompt="p")
    assert lease == ("lease", 1) and switch.freed == [lease]
    assert switch.acquire("two") is lease
    switch.release(lease, {"t": 1})
    assert switch.taken == ["one"] and switch.freed == [lease]
    relay = relay_class()
    assert relay.session_for("a", False) != relay.session_for("b", False)


def test_part_names_are_checked():
    assert overhead.parts("session,slot") == ("session", "slot")
    with pytest.raises(argparse.ArgumentTypeError, match="no part named slots"):
        overhead.parts("session,slots")


def test_build_refuses_an_unknown_part_before_building_anything(monkeypatch):
    monkeypatch.setenv("KVPROXY_BENCH_WITHOUT", "session,everything")
    with pytest.raises(SystemExit, match="no part named everything"):
        overhead_without.build()
