"""Protections of the slot switch that the swap tests alone do not reach (llama-server stubbed):
the save at shutdown, restart detection after an empty start, every part of the model
fingerprint, the cross-process lock, the restore-miss streak, clear() on ``default``,
and eviction as /metrics counts it."""
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvproxy import create_app
from kvproxy.sessions.identity import Session
from kvproxy.storage.store import SessionStore
from kvproxy.slots.switch import HIT, MISS, RESTORED, SlotBusy
from tests.fake_llama import UPSTREAM, FakePrompt, make_switch, MODEL
from tests.support import metric

A = Session("A", "test", system_hash="aaaa", model=MODEL)
B = Session("B", "test", system_hash="bbbb", model=MODEL)
DEFAULT = Session("default", "default", persistent=False, model=MODEL)



def answer(switch, session, fake, slot_tokens, cache_n=0, prompt=None):
    """One request: take the slot, 'generate' until it holds ``slot_tokens``, release."""
    lease = switch.acquire(session, prompt=prompt)
    fake.tokens = slot_tokens
    switch.release(lease, {"cache_n": cache_n, "prompt_n": slot_tokens - cache_n - 1,
                           "predicted_n": 1})
    return lease


# -- the save at shutdown ------------------------------------------------------
def test_checkpoint_saves_the_newest_tokens_and_a_restart_of_both_restores_them(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 100)
    answer(switch, B, fake, 100)     # A saved with 100 tokens
    answer(switch, A, fake, 100)     # A restored, B saved
    answer(switch, A, fake, 300)     # A grows after its last swap: its file still has 100
    assert SessionStore(tmp_path).read_sidecar(A.stem)["n_tokens"] == 100
    assert switch.checkpoint() is True
    assert SessionStore(tmp_path).read_sidecar(A.stem)["n_tokens"] == 300
    assert (tmp_path / f"{A.stem}.bin").stat().st_size == 300 + 4
    fake.tokens = 0                  # llama-server restarted; a new proxy over the same folder
    lease = make_switch(tmp_path).acquire(A)
    assert lease.cache == RESTORED and lease.restored_tokens == 300


def test_checkpoint_never_saves_default_or_an_emptied_slot(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, DEFAULT, fake, 50)
    assert switch.checkpoint() is False and not list(tmp_path.glob("*.bin"))
    answer(switch, A, fake, 50)
    fake.tokens = 0                  # llama-server restarted: nothing to save
    assert switch.checkpoint() is False and not list(tmp_path.glob("*.bin"))


# -- restart detection -----------------------------------------------------------
def test_restart_is_noticed_after_a_session_that_started_empty(tmp_path, fake):
    """Only the answer's timings say what the slot holds when the swap restored nothing."""
    switch = make_switch(tmp_path)
    assert answer(switch, A, fake, 40).cache == MISS
    fake.tokens = 0                  # llama-server restarted
    assert switch.acquire(A).cache != HIT, "the slot lost the session: not a hit"
    assert [a for a, _ in fake.actions] == ["erase", "erase"]


def test_an_emptied_slot_that_started_empty_is_not_saved_over_the_session(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 40)
    fake.tokens = 0                  # llama-server restarted
    answer(switch, B, fake, 40)
    assert ("save", f"{A.stem}.bin") not in fake.actions
    assert not SessionStore(tmp_path).has_bin(A.stem)


# -- an answer cut short (no timings: client gone, shutdown) ----------------------------
def test_after_an_answer_cut_short_the_next_swap_still_saves_what_the_slot_holds(tmp_path, fake):
    """Without timings, /slots (asked before the slot is freed) says what the slot holds."""
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 100)
    lease = switch.acquire(A)
    fake.tokens = 140                # the answer got this far before it was cut
    switch.release(lease)
    answer(switch, B, fake, 50)
    assert (SessionStore(tmp_path).read_sidecar(A.stem) or {}).get("n_tokens") == 140


@pytest.mark.parametrize("slots", ["unreachable", "without the slot"])
def test_when_slots_cannot_tell_after_a_cut_the_slot_keeps_its_record(tmp_path, fake,
                                                                     monkeypatch, slots):
    """The slot still holds what kvproxy recorded before the cut answer: it is still saved,
    and the answer still counts for its session."""
    from kvproxy.upstream.llama import UpstreamUnavailable

    def unreachable():
        raise UpstreamUnavailable("llama-server is not reachable")
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 100)
    lease = switch.acquire(A)
    with monkeypatch.context() as patch:
        patch.setattr(switch.client, "slots", unreachable if slots == "unreachable" else list)
        switch.release(lease)
    answer(switch, B, fake, 50)
    sidecar = switch.store.read_sidecar(A.stem) or {}
    assert (sidecar.get("n_tokens"), sidecar.get("hits")) == (100, 2)


def test_a_new_session_cut_before_its_slot_was_filled_needs_no_swap_next_time(tmp_path, fake,
                                                                              monkeypatch):
    """llama-server ran a task in the slot but kept no tokens: the slot is as empty as the
    swap left it, so the session's next request uses it as it is."""
    switch = make_switch(tmp_path)
    lease = switch.acquire(A)
    assert lease.cache == MISS       # the slot was erased for A
    monkeypatch.setattr(fake, "slot_entry", lambda slot=0: {
        "id": slot, "n_ctx": 8192, "is_processing": False, "id_task": 7, "n_prompt_tokens": 0})
    switch.release(lease)
    actions = len(fake.actions)
    assert switch.acquire(A).cache == HIT and len(fake.actions) == actions


# -- the model fingerprint ---------------------------------------------------------
def test_a_file_with_more_tokens_than_the_slot_is_never_restored(tmp_path, fake, caplog):
    """The sidecar's token count against the slot's n_ctx from /slots (llama-server would
    fail the restore and leave the slot wiped)."""
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 3000)
    answer(switch, B, fake, 5000)
    answer(switch, DEFAULT, fake, 10)  # B saved
    fake.n_ctx = 4096                  # /slots shows a smaller slot than /props reports
    fake.tokens = 0
    switch = make_switch(tmp_path)
    assert answer(switch, A, fake, 3001).cache == RESTORED, "3000 tokens fit a 4096-token slot"
    too_big = metric("kvproxy_restore_misses_total", reason="too_big")
    with caplog.at_level(logging.WARNING, logger="kvproxy.switch"):
        lease = answer(switch, B, fake, 20)
    assert lease.cache == MISS and ("restore", f"{B.stem}.bin") not in fake.actions
    sidecar = SessionStore(tmp_path).read_sidecar(B.stem)
    assert "5000 tokens" in sidecar["refused"] and "4096" in sidecar["refused"]
    assert sidecar["refused_at"] >= sidecar["saved_at"], "when it was refused"
    assert metric("kvproxy_restore_misses_total", reason="too_big") == too_big + 1
    assert "5000 tokens, more than the 4096-token context of slot 0" in caplog.text


def test_the_slot_size_is_asked_for_a_restore_into_a_slot_the_swap_did_not_look_at(tmp_path, fake):
    """A slot marked unproven is not asked about before the swap (nothing in it is trusted),
    so a new process has not seen its size yet when the restore is judged."""
    switch = make_switch(tmp_path)
    answer(switch, B, fake, 5000)
    answer(switch, DEFAULT, fake, 10)  # B saved
    switch.mark_unknown(0)             # e.g. a swap that failed half-way
    fake.n_ctx = 4096                  # /slots shows a smaller slot than /props reports
    lease = answer(make_switch(tmp_path), B, fake, 20)
    assert lease.cache == MISS and ("restore", f"{B.stem}.bin") not in fake.actions
    assert "5000 tokens" in SessionStore(tmp_path).read_sidecar(B.stem)["refused"]


def _change_model(fake, part: str) -> None:
    settings = fake.props["default_generation_settings"]
    meta = fake.models["data"][0]["meta"]
    if part == "model_path":
        # another file of the same name: files carry the name's tag, the fingerprint the path
        fake.props["model_path"] = "/elsewhere/tiny.gguf"
    elif part == "n_ctx":
        settings["n_ctx"] = settings["n_ctx"] // 2
    elif part == "build_info":
        fake.props["build_info"] = "b2-other"
    elif part == "model_size":
        meta["size"] += 1
    elif part == "n_params":
        meta["n_params"] += 1


@pytest.mark.parametrize("part", ["model_path", "n_ctx", "build_info", "model_size", "n_params"])
def test_file_made_with_anything_else_is_refused(tmp_path, fake, part):
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 100)
    answer(switch, B, fake, 100)
    _change_model(fake, part)
    lease = switch.acquire(A)
    assert lease.cache == MISS
    assert ("restore", f"{A.stem}.bin") not in fake.actions
    assert SessionStore(tmp_path).read_sidecar(A.stem)["refused"]


# -- two proxies on one slot folder --------------------------------------------------
def test_two_proxies_on_one_slot_folder_take_turns(tmp_path, fake):
    """Two switches (two processes) with their own thread locks share the folder's lock;
    the second asked for it while it waited, so the first lets its file lock go at its
    release instead of keeping it for its own next request."""
    first = make_switch(tmp_path, lock_timeout=0.3)
    second = make_switch(tmp_path, lock_timeout=0.3)
    lease = first.acquire(A)
    with pytest.raises(SlotBusy):
        second.acquire(B)
    fake.tokens = 20
    first.release(lease, {"cache_n": 0, "prompt_n": 19, "predicted_n": 1})
    assert second.acquire(B).cache == MISS
    assert fake.actions[-2:] == [("save", f"{A.stem}.saving.bin"), ("erase", None)]
    assert SessionStore(tmp_path).has_bin(A.stem)


# -- the restore-miss streak ------------------------------------------------------------
def test_an_honoured_restore_resets_the_streak_of_unhonoured_ones(tmp_path, fake):
    switch = make_switch(tmp_path, restore_miss_limit=2)
    fake.slot_token_ids = list(range(1000))  # every prompt below starts with the restored tokens
    prompt = FakePrompt(range(600))
    answer(switch, A, fake, 500)
    answer(switch, B, fake, 500)
    assert answer(switch, A, fake, 510, 0, prompt).cache == RESTORED     # not honoured: 1
    assert answer(switch, B, fake, 510, 499, prompt).cache == RESTORED   # honoured: back to 0
    assert answer(switch, A, fake, 520, 0, prompt).cache == RESTORED     # not honoured: 1
    assert switch.acquire(B).cache == RESTORED, "one miss in a row must not switch restoring off"


# -- clear() ----------------------------------------------------------------------------
def test_clear_erases_a_slot_that_already_holds_default(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, DEFAULT, fake, 30)
    erases = fake.actions.count(("erase", None))
    switch.clear()
    assert fake.actions.count(("erase", None)) == erases + 1 and fake.tokens == 0


# -- eviction ---------------------------------------------------------------------------
def _sample(client, name: str) -> float:
    text = client.get("/metrics").get_data(as_text=True)
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name), 0.0)


def test_evictions_show_in_metrics(tmp_path, fake):
    """Each saved file is 16 bytes; a bound of 40 bytes keeps two of them."""
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                      "max_disk_gb": 40.5 / 1024**3, "base_snapshots": False})
    client = app.test_client()
    before = _sample(client, "kvproxy_evictions_total"), _sample(client, "kvproxy_evicted_bytes_total")
    names = ["s1", "s2", "s3", "s4", "s1"]
    for name in names:
        reply = client.post("/v1/chat/completions", headers={"X-Session-Id": name},
                            json={"messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200
    # saves go to <stem>.saving.bin and are renamed to <stem>.bin once checked
    saved = {file.replace(".saving.bin", ".bin") for action, file in fake.actions if action == "save"}
    gone = [file for file in saved if not (tmp_path / file).exists()]
    assert len(saved) == 4 and len(gone) == 2, (saved, gone)
    assert sum(p.stat().st_size for p in tmp_path.glob("*.bin")) <= 40
    assert _sample(client, "kvproxy_evictions_total") == before[0] + len(gone)
    assert _sample(client, "kvproxy_evicted_bytes_total") == before[1] + 16 * len(gone)


@pytest.mark.parametrize("slot,empty", [
    ({"id": 0, "n_ctx": 8192}, True),                                 # fresh llama-server
    ({"id": 0, "id_task": 7, "n_prompt_tokens": 0}, True),            # a task ran, then emptied
    ({"id": 0, "id_task": 7, "n_prompt_tokens": 120}, False),
])
def test_what_counts_as_an_emptied_slot(slot, empty):
    """kvproxy left 120 tokens in the slot; /slots decides (plan.judge_slot) whether it was emptied."""
    from kvproxy.slots.plan import EMPTY, OURS, judge_slot
    assert judge_slot(slot, 120) == (EMPTY if empty else OURS)
