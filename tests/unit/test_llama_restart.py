"""llama-server restarted under a running kvproxy: the restart is seen in /slots, and what
kvproxy learned of the old process (slots, sizes, fingerprint, KV format) is learned again
before a swap plans (stubbed llama-server)."""
import pytest
import responses

from kvproxy.slots import restore_probe
from kvproxy.slots.instance import Listing, driven_slots, of_listing, restarted
from kvproxy.slots.state import Phase
from kvproxy.slots.switch import MISS, RESTORED
from tests.fake_llama import FakeLlama
from tests.support import PLAIN_A as A, PLAIN_B as B, PLAIN_C as C, switch_over

Q8 = "k=q8_0 v=q8_0 v_trans=0 layers=30 rot=0,0"
F16 = "k=f16 v=f16 v_trans=0 layers=30 rot=0,0"


def entry(slot, n_ctx=2048, task=None):
    return {"id": slot, "n_ctx": n_ctx, "is_processing": False,
            **({"id_task": task, "n_prompt_tokens": 5} if task is not None else {})}


def test_a_listing_tells_the_slot_count_their_sizes_and_the_last_task():
    assert of_listing([entry(1, task=7), entry(0, task=3)]) == Listing((2048, 2048), 7)
    assert of_listing([entry(0)]) == Listing((2048,), -1)
    assert of_listing({"error": "x"}) is None and of_listing([]) is None


@pytest.mark.parametrize("now, why", [
    (Listing((2048, 2048)), "2 slot(s), it had 4"),
    (Listing((4096,) * 4, 9), "its slots hold"),
    (Listing((2048,) * 4, -1), "task ids started again"),
    (Listing((2048,) * 4, 3), "task ids started again"),
])
def test_a_listing_of_another_process_is_a_restart(now, why):
    assert why in restarted(Listing((2048,) * 4, 5), now)


def test_the_same_process_running_more_tasks_is_no_restart():
    before = Listing((2048,) * 2, 5)
    assert restarted(before, Listing((2048,) * 2, 5)) is None
    assert restarted(before, Listing((2048,) * 2, 80)) is None
    assert restarted(None, before) is None and restarted(before, None) is None


@pytest.mark.parametrize("configured, slot_id, total, driven", [
    (0, 0, 4, [0, 1, 2, 3]), (0, 0, None, None), (0, 2, 1, [2]), (1, 3, 2, [3]),
    (4, 0, 2, [0, 1]), (4, 0, 8, [0, 1, 2, 3]), (3, 0, None, [0, 1, 2])])
def test_kvproxy_drives_no_slot_llama_server_does_not_have(configured, slot_id, total, driven):
    assert driven_slots(configured, slot_id, total) == driven


@pytest.fixture
def mock():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as m:
        yield m


@pytest.fixture
def probed(monkeypatch):
    """The restore probe, stubbed: the slots it ran in; its KV format is ``probed.format``."""
    class Probed(list):
        format, fake = Q8, None   # the stub llama-server the probe runs a task in
    slots = Probed()

    def probe(slot, name):   # no step of its own: the verdict at once
        slots.append(slot)
        if slots.fake is not None:
            slots.fake.last_task += 1
            slots.fake.tasks[slot] = slots.fake.last_task
        return restore_probe.ProbeVerdict(True, 120, 119, slots.format)
        yield
    monkeypatch.setattr(restore_probe, "probe", probe)
    return slots


def answer(switch, session, fake, tokens=20):
    """A request's turn: llama-server runs a task in the slot (task ids count up)."""
    lease = switch.acquire(session)
    fake.last_task += 1
    fake.tasks[lease.slot], fake.held[lease.slot] = fake.last_task, tokens
    switch.release(lease, {"cache_n": 0, "prompt_n": tokens - 1, "predicted_n": 1})
    return lease


def test_with_fewer_slots_after_a_restart_no_slot_id_wraps_onto_another(mock, tmp_path, probed):
    fake = probed.fake = FakeLlama(mock, tmp_path, n_slots=4)
    switch = switch_over(tmp_path)
    held = {s.id: answer(switch, s, fake).slot for s in (A, B, C)}
    assert sorted(held.values()) == [0, 1, 2]
    fake.restart(n_slots=2)
    fake.slot_actions.clear()
    lease = answer(switch, C, fake)       # C's slot 2 is gone
    assert switch.slot_ids() == [0, 1] and lease.slot in (0, 1)
    assert probed == [lease.slot], "the KV format is learned again, in the slot taken"
    assert lease.cache == MISS, "C's turn was never saved: lost with the old process"
    assert switch.table.get(2).phase is Phase.EMPTY, "a slot llama-server no longer has"
    others = [answer(switch, s, fake) for s in (A, B)]
    assert all(s < 2 for s, _, _ in fake.slot_actions), fake.slot_actions
    assert all(lease.cache != "hit" for lease in others), "each was emptied by the restart"
    assert probed == [lease.slot], "probed once"


def test_after_a_restart_with_other_cache_types_no_old_file_is_offered(mock, tmp_path, probed):
    fake = probed.fake = FakeLlama(mock, tmp_path, n_slots=1)
    switch = switch_over(tmp_path, slots=1)
    switch.executor.memory.note_kv_format(F16)  # from the start-up probe
    for session in (A, B, C):
        answer(switch, session, fake)     # A and B saved, as f16
    fake.restart()
    fake.actions.clear()
    lease = answer(switch, A, fake)
    assert switch.kv_format == Q8 and probed == [0]
    assert lease.cache == MISS and fake.actions == [("erase", None)], \
        "A's f16 file is not offered to llama-server"
    probed.format = F16
    fake.restart()
    assert answer(switch, B, fake).cache == RESTORED, "back on f16: B's own file"
    assert probed == [0, 0]
    assert switch.kv_format == F16


def test_the_same_process_seen_again_is_not_probed(mock, tmp_path, probed):
    fake = FakeLlama(mock, tmp_path, n_slots=2)
    switch = switch_over(tmp_path)
    answer(switch, A, fake)
    switch.client.still_open = lambda witness: False  # connections closed, same process
    answer(switch, B, fake)
    assert answer(switch, A, fake).cache == "hit"
    answer(switch, C, fake)
    assert probed == []


def test_a_configured_slot_id_past_the_new_slot_count_is_reported(mock, tmp_path, probed,
                                                                   caplog):
    fake = probed.fake = FakeLlama(mock, tmp_path, n_slots=2)
    switch = switch_over(tmp_path, slots=1, slot_id=1)
    answer(switch, A, fake)
    fake.restart(n_slots=1)
    switch.release(switch.acquire(B))
    assert switch.slot_ids() == [1]
    assert "KVPROXY_SLOT_ID=1, but llama-server now has 1 slot(s)" in caplog.text
