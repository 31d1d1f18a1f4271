"""The start-up restore probe: its verdict, the KV format it reads, the slot it uses."""
from __future__ import annotations

import pytest

from kvproxy.slots.executor import SlotExecutor
from kvproxy.slots.plan import fingerprint_key
from kvproxy.slots.restore_probe import PROBE_TEXT, probe, probe_name, prove_restores
from kvproxy.slots.state import Phase, SlotState, SlotTable
from kvproxy.storage.folder import FolderFiles
from kvproxy.storage.store import SessionStore
from kvproxy.upstream.llama import UpstreamError
from tests.fake_llama import make_switch
from tests.support import slot_file


class ProbeClient:
    """Answers the probe's calls as llama-server does; ``reuses`` is what the answer after the
    restore reports as cache_n (0: a sliding-window model without --swa-full)."""

    def __init__(self, root, reuses: int | None = None, fail_at: str | None = None,
                 holds: int = 0):
        self.root, self.reuses, self.fail_at, self.calls = root, reuses, fail_at, []
        self.n = len(PROBE_TEXT.split())
        self.holds = holds  # what /slots shows slot 0 holding before the probe

    def slots(self):
        return [{"id": 0, "id_task": 1, "n_prompt_tokens": self.holds}]

    def _step(self, name):
        self.calls.append(name)
        if name == self.fail_at:
            raise UpstreamError(400, f"{name} refused")

    def tokenize(self, text):
        self._step("tokenize")
        return list(range(self.n))

    def prefill(self, tokens, slot):
        self._step("prefill")
        return {"timings": {"prompt_n": len(tokens)}}

    def slot_action(self, slot, action, filename=None):
        self._step(action)
        if action == "save":
            slot_file(self.root / filename, cells=self.n, k_type=8, v_type=8)
        return {"n_restored": self.n} if action == "restore" else {}

    def post_json(self, path, body):
        self._step("completion")
        reused = self.n - 1 if self.reuses is None else self.reuses
        return {"timings": {"cache_n": reused, "prompt_n": self.n - reused}}


def probed(client, root, slot: int = 0):
    """The probe in ``slot``, its steps performed by an executor of the folder ``root``
    talking to ``client``."""
    store = SessionStore(root)
    executor = SlotExecutor(client, store, SlotTable(store), FolderFiles(store))
    return executor.run(probe(slot, probe_name()))


def test_a_restore_that_is_reused_passes_and_the_probe_file_is_gone(tmp_path):
    verdict = probed(ProbeClient(tmp_path), tmp_path)
    assert verdict.honoured is True and verdict.kv_format.startswith("k=q8_0 v=q8_0")
    assert verdict.reused == verdict.restored - 1
    assert not list(tmp_path.glob("probe.*"))


def test_a_restore_that_is_recomputed_fails(tmp_path):
    client = ProbeClient(tmp_path, reuses=0)
    assert probed(client, tmp_path).honoured is False
    assert client.calls == ["tokenize", "prefill", "save", "erase", "restore", "completion",
                            "erase"]


@pytest.mark.parametrize("step", ["tokenize", "save", "restore"])
def test_a_probe_that_cannot_finish_says_so_and_leaves_no_file(tmp_path, step):
    verdict = probed(ProbeClient(tmp_path, fail_at=step), tmp_path)
    assert verdict.honoured is None and f"{step} refused" in verdict.detail
    assert verdict.touched is (step != "tokenize")
    assert not list(tmp_path.glob("probe.*"))


def test_a_failed_probe_switches_restoring_off_naming_the_cause(fake, tmp_path):
    switch = make_switch(tmp_path)
    prove_restores(switch, ProbeClient(tmp_path, reuses=0))
    key = fingerprint_key(switch.current_made_by())
    assert "kv_format" in switch.current_made_by()
    status = switch.restore_check.status(key)
    assert status["restoring_off"] and status["cause"]


def test_a_passing_probe_ends_an_earlier_switch_off(fake, tmp_path):
    """llama-server restarted with the fix: what was measured decides, not the model file."""
    switch = make_switch(tmp_path)
    prove_restores(switch, ProbeClient(tmp_path, reuses=0))
    key = fingerprint_key(switch.current_made_by())
    assert switch.restore_check.restoring_off(key)
    verdict = prove_restores(switch, ProbeClient(tmp_path))
    assert verdict.honoured and not switch.restore_check.restoring_off(key)


def test_the_probe_never_uses_a_slot_that_holds_a_session(fake, tmp_path):
    """A kvproxy restart in front of a running llama-server keeps the session in its slot."""
    switch = make_switch(tmp_path)
    held = SlotState(Phase.OURS, session_id="A", key="kA", stem="A", persistent=True, tokens=9)
    switch.table.put(0, held)
    client = ProbeClient(tmp_path, holds=9)
    assert prove_restores(switch, client) is None and client.calls == []
    assert switch.table.get(0) == held


def test_a_slot_llama_server_emptied_by_a_restart_is_used_for_the_probe(fake, tmp_path):
    switch = make_switch(tmp_path)
    switch.table.put(0, SlotState(Phase.OURS, session_id="A", key="kA", stem="A",
                                  persistent=True, tokens=9))
    assert prove_restores(switch, ProbeClient(tmp_path, holds=0)).honoured
    assert switch.table.get(0).phase is Phase.EMPTY


def test_the_probe_empties_the_slot_it_used_and_a_half_done_probe_leaves_it_unproven(fake, tmp_path):
    switch = make_switch(tmp_path)
    switch.table.put(0, SlotState(Phase.UNPROVEN, tokens=5))
    prove_restores(switch, ProbeClient(tmp_path))
    assert switch.table.get(0).phase is Phase.EMPTY
    prove_restores(switch, ProbeClient(tmp_path, fail_at="restore"))
    assert switch.table.get(0).phase is Phase.UNPROVEN


def test_a_slot_emptied_while_restoring_is_off_is_probed_again(fake, tmp_path, monkeypatch):
    """llama-server restarted under a running kvproxy (with --swa-full, say): the next swap
    finds the slot empty, measures again, and restoring is on for that same swap."""
    from kvproxy.sessions.identity import Session
    from kvproxy.slots import restore_probe
    switch = make_switch(tmp_path)
    key = fingerprint_key(switch.current_made_by())
    switch.restore_check.measured(key, False, "a sliding-window model")
    switch.table.put(0, SlotState(Phase.OURS, session_id="A", key="kA", stem="A",
                                  persistent=True, tokens=9))   # /slots shows the slot empty
    probed = []

    def probe(slot, name):   # no step of its own: the verdict at once
        probed.append(slot)
        return restore_probe.ProbeVerdict(True, 120, 119)
        yield
    monkeypatch.setattr(restore_probe, "probe", probe)
    switch.release(switch.acquire(Session("B", "test")), {})
    assert probed == [0] and not switch.restore_check.restoring_off(key)
    probed.clear()
    switch.restore_check.measured(key, False, "a sliding-window model")
    switch.release(switch.acquire(Session("C", "test")), {})
    assert probed == [], "a slot that still holds what kvproxy left is not probed"
