"""Noticing a llama-server restart without asking /slots on every request (real llama-server)."""
import pytest

from kvproxy.sessions.identity import Session
from kvproxy.upstream.llama import LlamaClient
from kvproxy.launch.processes import LlamaServer
from kvproxy.storage.store import SessionStore
from kvproxy.slots.switch import HIT, RESTORED, SlotSwitch
from tests.conftest import long_text

pytestmark = pytest.mark.real

SYSTEM = long_text(400, seed=505)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    server = LlamaServer(str(tmp_path_factory.mktemp("slots")), ctx_size=2048)
    server.start()
    yield server
    server.stop()


class CountingClient(LlamaClient):
    """Counts the /slots round trips the switch makes."""

    slots_calls = 0

    def slots(self):
        self.slots_calls += 1
        return super().slots()


def turn(switch, client, session, question):
    lease = switch.acquire(session)
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0, "cache_prompt": True, "id_slot": 0}
    timings = {}
    try:
        timings = client.post_json("/v1/chat/completions", body)["timings"]
    finally:
        switch.release(lease, timings)
    return lease, timings


def test_open_connection_spares_slots_check_and_a_restart_is_still_noticed(llama):
    client = CountingClient(llama.url, read_timeout=120)
    # Not the shipped defaults: its requests are pinned to slot 0 (one slot), and it counts
    # /slots round trips, which a background save would add to.
    switch = SlotSwitch(client, SessionStore(llama.slot_dir), base_snapshots=False, slots=1,
                        save_behind=False)
    a, b = Session("a", "test"), Session("b", "test")
    turn(switch, client, a, "Name rule 1.")
    turn(switch, client, b, "Name rule 2.")   # saves a
    turn(switch, client, a, "Name rule 1.")   # restores a

    before = client.slots_calls
    lease, timings = turn(switch, client, a, "Name rule 3.")
    assert lease.cache == HIT and client.slots_calls == before, "no /slots call while connected"

    llama.restart()                            # same port, empty slot
    lease, timings = turn(switch, client, a, "Name rule 3.")
    assert client.slots_calls == before + 1
    assert lease.cache == RESTORED
    assert timings["cache_n"] >= 0.9 * (timings["cache_n"] + timings["prompt_n"]), timings

    # A swap saves the slot over a file: it always asks /slots, open connection or not.
    lease, _ = turn(switch, client, b, "Name rule 2.")
    assert lease.cache == RESTORED and client.slots_calls == before + 2
