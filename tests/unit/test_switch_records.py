"""What the switch records about each swap (llama-server stubbed): sidecar fields that
/api/sessions lists, /metrics counters, the log lines that say why, and forget()."""
import logging
import threading
import time

import pytest
import responses

from kvproxy.sessions.identity import Session, base_stem
from kvproxy.slots.restore_check import UNKNOWN_CAUSE
from kvproxy.upstream.llama import UpstreamError
from kvproxy.storage.store import SessionStore
from kvproxy.slots.switch import MISS, RESTORED, SlotBusy
from tests.fake_llama import UPSTREAM, FakePrompt, make_switch, MODEL
from tests.support import metric

A = Session("A", "test", system_hash="aaaa", key="A#aaaa", model=MODEL)
B = Session("B", "test", system_hash="bbbb", model=MODEL)
DEFAULT = Session("default", "default", persistent=False, model=MODEL)



def answer(switch, session, fake, slot_tokens=100, cache_n=0, prompt=None):
    lease = switch.acquire(session, prompt=prompt)
    fake.tokens = slot_tokens
    switch.release(lease, {"cache_n": cache_n, "prompt_n": slot_tokens - cache_n - 1,
                           "predicted_n": 1})
    return lease


def messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


# -- save and restore ------------------------------------------------------------
def test_save_and_restore_are_recorded_in_the_sidecar_and_metrics(tmp_path, fake):
    switch = make_switch(tmp_path)
    store = switch.store             # with the notes of answers held in this process
    before = {kind: (metric("kvproxy_swap_bytes_total", kind=kind),
                     metric("kvproxy_swap_seconds_count", kind=kind),
                     metric("kvproxy_swap_seconds_sum", kind=kind)) for kind in ("save", "restore")}
    answer(switch, A, fake, 100)
    answer(switch, B, fake, 50)            # saves A: 100 tokens, 104 bytes
    saved = store.read_sidecar(A.stem)
    assert (saved["session_id"], saved["kind"], saved["system_hash"]) == ("A", "session", "aaaa")
    assert (saved["n_tokens"], saved["n_bytes"], saved["save_ms"]) == (100, 104, 1.23)
    assert saved["saved_at"] and saved["refused"] is None and not saved.get("restores")
    answer(switch, A, fake, 120, cache_n=100)  # saves B, restores A
    restored = store.read_sidecar(A.stem)
    assert (restored["restores"], restored["restore_ms"]) == (1, 0.46)
    assert restored["last_used_at"] >= restored["saved_at"]
    assert metric("kvproxy_swap_bytes_total", kind="save") == before["save"][0] + 104 + 54
    assert metric("kvproxy_swap_bytes_total", kind="restore") == before["restore"][0] + 104
    assert metric("kvproxy_swap_seconds_count", kind="save") == before["save"][1] + 2
    assert metric("kvproxy_swap_seconds_count", kind="restore") == before["restore"][1] + 1
    for kind in ("save", "restore"):  # seconds, measured around each action
        assert 0 < metric("kvproxy_swap_seconds_sum", kind=kind) - before[kind][2] < 60


def test_without_llama_server_timings_the_measured_time_is_recorded(tmp_path, fake):
    fake.slot_timings = False
    switch = make_switch(tmp_path)
    answer(switch, A, fake)
    answer(switch, B, fake)
    answer(switch, A, fake)
    sidecar = switch.store.read_sidecar(A.stem)
    assert 0 < sidecar["save_ms"] < 5000 and 0 < sidecar["restore_ms"] < 5000


def test_a_failed_restore_is_counted_and_logged(tmp_path, fake, caplog):
    switch = make_switch(tmp_path)
    answer(switch, A, fake)
    answer(switch, B, fake)
    fake.fail_restore = True
    before = metric("kvproxy_restore_misses_total", reason="failed")
    with caplog.at_level(logging.WARNING, logger="kvproxy.switch"):
        assert switch.acquire(A).cache == MISS
    assert metric("kvproxy_restore_misses_total", reason="failed") == before + 1
    assert f"restore of {A.stem}.bin failed: Unable to restore slot" in messages(caplog)
    assert not SessionStore(tmp_path).read_sidecar(A.stem).get("restores")


def test_a_file_llama_server_refuses_is_recorded_and_not_offered_to_it_again(tmp_path, fake):
    """Another KV format (cache types, flash attention) than the running server's: one failed
    restore, then the file is left alone until a save replaces it."""
    switch = make_switch(tmp_path)
    answer(switch, A, fake)
    answer(switch, B, fake)
    fake.fail_restore = True
    lease = switch.acquire(A)
    assert lease.cache == MISS
    sidecar = SessionStore(tmp_path).read_sidecar(A.stem)
    assert sidecar["refused"] == "Unable to restore slot"
    assert sidecar["refused_by"] == switch.current_made_by()
    switch.release(lease, {})     # A's turn is not answered: its old file stays
    answer(switch, B, fake)
    fake.fail_restore = False
    fake.actions.clear()
    assert switch.acquire(A).cache == MISS
    assert ("restore", f"{A.stem}.bin") not in fake.actions


def test_unhonoured_restores_are_logged_and_switch_off_names_the_way_back(tmp_path, fake, caplog):
    switch = make_switch(tmp_path, restore_miss_limit=1)
    fake.slot_token_ids = list(range(1000))
    answer(switch, A, fake, 500)
    answer(switch, B, fake, 500)
    with caplog.at_level(logging.WARNING, logger="kvproxy.switch"):  # the prompt starts with them
        answer(switch, A, fake, 510, cache_n=0, prompt=FakePrompt(range(510)))
    assert "restore of session A not honoured: 500 tokens restored, 0 reused (1 in a row)" \
        in messages(caplog)
    assert ("restoring switched off for this model for 60 minutes after 1 unhonoured restores "
            f"({UNKNOWN_CAUSE}); POST /api/sessions/restore-check/reset turns it back on") \
        in messages(caplog)
    assert switch.restore_check.status(None)["cause"] == UNKNOWN_CAUSE, \
        "the status page and ps name it too"


@pytest.mark.parametrize("restored,reused,counted", [(64, 0, True), (63, 0, False),
                                                     (500, 50, False), (500, 49, True)])
def test_which_restores_count_as_not_honoured(tmp_path, fake, restored, reused, counted):
    """Restores of at least 64 tokens are checked; reusing a tenth of them is honoured
    (the prompt starts with every restored token)."""
    switch = make_switch(tmp_path)
    fake.slot_token_ids = list(range(1000))
    answer(switch, A, fake, restored)
    answer(switch, B, fake, restored)
    answer(switch, A, fake, restored + 10, cache_n=reused, prompt=FakePrompt(range(restored + 10)))
    assert bool(SessionStore(tmp_path).read_sidecar(A.stem).get("restore_not_honoured_at")) == counted


def test_an_empty_file_restores_no_tokens(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, A, fake)
    answer(switch, B, fake)
    (tmp_path / f"{A.stem}.bin").write_bytes(b"ggsq")  # a slot file of no tokens
    SessionStore(tmp_path).update_sidecar(A.stem, {}, saved_bytes=4)  # its sidecar agrees
    lease = switch.acquire(A)
    assert (lease.cache, lease.restored_tokens) == (RESTORED, 0)


def test_a_failed_save_is_logged_and_keeps_the_older_file(tmp_path, fake, caplog):
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 100)
    answer(switch, B, fake, 100)          # A saved: 100 tokens
    answer(switch, A, fake, 150)          # A restored, grows to 150
    fake.fail_save = True
    with caplog.at_level(logging.WARNING, "kvproxy"):
        answer(switch, B, fake)               # the save is dropped, the request answers
    assert any("dropped the save of session A" in r.message
               and "failed to save slot; the previous file is kept" in r.message
               for r in caplog.records)
    assert SessionStore(tmp_path).read_sidecar(A.stem)["n_tokens"] == 100
    assert (tmp_path / f"{A.stem}.bin").stat().st_size == 104
    assert not (tmp_path / f"{A.stem}.saving.bin").exists()


# -- base snapshots ----------------------------------------------------------------
def test_base_snapshot_sidecar_and_metric(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=True)
    before = metric("kvproxy_swaps_total", kind="base")
    answer(switch, A, fake, prompt=FakePrompt(range(110), list(range(100))))
    base = SessionStore(tmp_path).read_sidecar(base_stem("aaaa", MODEL))
    assert (base["session_id"], base["kind"], base["system_hash"]) == ("base:aaaa", "base", "aaaa")
    assert metric("kvproxy_swaps_total", kind="base") == before + 1


def test_the_base_prefill_counts_its_tokens_computed_and_the_request_what_it_reused(
        tmp_path, fake):
    """The prefill is kvproxy's own request: no answer reports the tokens it computed, so the
    switch counts them when it makes the base, even for a request that then fails. What the
    prefill found cached (llama-server's RAM cache) counts as reused once the request reuses
    it, as the request's usage and the status page report it."""
    switch = make_switch(tmp_path, base_snapshots=True)
    fake.prefill_reused = 30
    reused, computed = metric("kvproxy_prompt_tokens_total", kind="reused"), \
        metric("kvproxy_prompt_tokens_total", kind="computed")
    lease = switch.acquire(A, prompt=FakePrompt(range(110), list(range(100))))
    assert metric("kvproxy_prompt_tokens_total", kind="computed") == computed + 70
    switch.release(lease, {"cache_n": 100, "prompt_n": 10, "predicted_n": 1})
    assert metric("kvproxy_prompt_tokens_total", kind="reused") == reused + 30
    assert metric("kvproxy_prompt_tokens_total", kind="computed") == computed + 80
    assert switch.activity.totals()["tokens"] == {"reused": 30, "computed": 80}
    assert SessionStore(tmp_path).read_sidecar(base_stem("aaaa", MODEL))["prefill_computed"] == 70


def test_a_prefill_served_from_cache_counts_nothing_computed(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=True)
    fake.prefill_reused = 1000
    computed = metric("kvproxy_prompt_tokens_total", kind="computed")
    switch.release(switch.acquire(A, prompt=FakePrompt(range(110), list(range(100)))))
    assert metric("kvproxy_prompt_tokens_total", kind="computed") == computed
    assert SessionStore(tmp_path).read_sidecar(base_stem("aaaa", MODEL))["prefill_computed"] == 0


@pytest.mark.parametrize("why", ["short system prompt", "prefill failed"])
def test_without_a_base_the_slot_is_recorded_empty(tmp_path, fake, monkeypatch, why):
    """The state says what the slot holds after the swap: nothing, when no base was made."""
    switch = make_switch(tmp_path, base_snapshots=True)
    system = list(range(100))
    if why == "short system prompt":
        system = list(range(10))
    else:
        def refuse(tokens, slot):
            raise UpstreamError(500, "prefill failed")
        monkeypatch.setattr(switch.client, "prefill", refuse)
    lease = switch.acquire(A, prompt=FakePrompt(range(110), system))
    try:
        assert lease.cache == MISS and lease.restored_tokens == 0
        assert SessionStore(tmp_path).read_state(lease.slot)["slot_tokens"] == 0
    finally:
        switch.release(lease)
    assert not list(tmp_path.glob("base.*"))


def test_no_base_from_a_side_request_or_a_prompt_without_system(tmp_path, fake):
    """A side request (title, tags) is not a conversation: its system prompt is no base."""
    switch = make_switch(tmp_path, base_snapshots=True)
    prompt = FakePrompt(range(110), list(range(100)))
    answer(switch, Session("task", "side-request", persistent=False, system_hash="aaaa", model=MODEL),
           fake, prompt=prompt)
    answer(switch, Session("plain", "test", model=MODEL), fake, prompt=prompt)   # no system hash
    assert fake.prefills == [] and not list(tmp_path.glob("base.*"))


def test_a_base_is_not_saved_again_when_a_session_starts_empty(tmp_path, fake):
    """A session that cannot use the base (its restore failed) must not overwrite it."""
    switch = make_switch(tmp_path, base_snapshots=True)
    prompt = FakePrompt(range(110), list(range(100)))
    answer(switch, A, fake, prompt=prompt)
    fake.fail_restore = True
    assert answer(switch, Session("A2", "test", system_hash="aaaa", model=MODEL), fake, prompt=prompt).cache == MISS
    assert fake.actions.count(("save", f"{base_stem('aaaa', MODEL)}.saving.bin")) == 1


# -- shutdown save -------------------------------------------------------------------
def test_checkpoint_keeps_the_session_fields(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 80)
    assert switch.checkpoint()
    sidecar = SessionStore(tmp_path).read_sidecar(A.stem)
    assert (sidecar["session_id"], sidecar["kind"], sidecar["system_hash"]) == ("A", "session", "aaaa")


def test_checkpoint_gives_up_while_the_slot_is_busy(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 80)
    lease = switch.acquire(A)
    try:
        assert switch.checkpoint(timeout=0.2) is False
    finally:
        switch.release(lease)
    assert ("save", f"{A.stem}.bin") not in fake.actions


def test_checkpoint_waits_for_a_request_that_ends_within_its_bound(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 80)
    lease = switch.acquire(A)
    ends = threading.Timer(0.3, switch.release, [lease, {"cache_n": 79, "prompt_n": 0,
                                                         "predicted_n": 1}])
    ends.start()
    try:
        assert switch.checkpoint(timeout=60) is True
    finally:
        ends.join(10)
    assert SessionStore(tmp_path).read_sidecar(A.stem)["n_tokens"] == 80


def test_checkpoint_without_llama_server_says_so(tmp_path, fake, caplog):
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 80)
    fake.mock.replace(responses.GET, f"{UPSTREAM}/props", status=503, json={"error": "loading"})
    with caplog.at_level(logging.WARNING, logger="kvproxy.switch"):
        assert switch.checkpoint() is False
    [line] = [m for m in messages(caplog) if m.startswith("could not save the active session")]
    assert line == "could not save the active session of slot 0 at shutdown: loading"  # its reason


# -- clear and forget ----------------------------------------------------------------
def test_after_clear_nothing_is_saved_as_default(tmp_path, fake, caplog):
    switch = make_switch(tmp_path)
    answer(switch, A, fake)
    with caplog.at_level(logging.INFO, logger="kvproxy.switch"):
        switch.clear()
    assert "swap to session=default source=admin" in caplog.text
    assert ("save", f"{A.stem}.saving.bin") in fake.actions  # clear() saved A
    saves = [a for a, _ in fake.actions].count("save")
    answer(switch, B, fake)
    assert [a for a, _ in fake.actions].count("save") == saves
    assert not list(tmp_path.glob("default*"))


def test_forget_deletes_every_file_of_the_id_and_nothing_else(tmp_path, fake):
    switch = make_switch(tmp_path)
    other_prompt = Session("A", "test", system_hash="cccc", key="A#cccc", model=MODEL)
    answer(switch, A, fake)
    answer(switch, other_prompt, fake)
    answer(switch, B, fake)
    answer(switch, Session("C", "test", model=MODEL), fake)       # A's and B's files are all on disk
    orphan = tmp_path / f"{Session('A', 'admin', model=MODEL).stem}.bin"
    orphan.write_bytes(b"ggsq")                      # a file left without its sidecar
    assert switch.forget("A") is True
    assert not orphan.exists()
    left = {s["session_id"] for s in SessionStore(tmp_path).sidecars()}
    assert "A" not in left and {"B", "C"} <= left
    assert (tmp_path / f"{B.stem}.bin").exists()
    assert switch.forget("A") is False


def test_forgetting_the_active_session_empties_the_slot_and_the_state(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, A, fake, 90)
    updated = SessionStore(tmp_path).read_state()["updated_at"]
    time.sleep(0.01)
    assert switch.forget("A") is True
    assert fake.actions[-1] == ("erase", None) and fake.tokens == 0
    state = SessionStore(tmp_path).read_state()
    assert (state["active"], state["active_key"], state["active_stem"]) == ("default", None, None)
    assert (state["active_persistent"], state["active_system_hash"], state["slot_tokens"]) == \
        (False, None, 0)
    assert state["updated_at"] > updated
    actions = len(fake.actions)
    assert switch.acquire(B).cache == MISS
    assert fake.actions[actions:] == [("erase", None)], "nothing is saved for a forgotten session"


def test_forget_is_bounded_by_the_lock(tmp_path, fake):
    switch = make_switch(tmp_path, lock_timeout=0.2)
    lease = switch.acquire(A)
    try:
        with pytest.raises(SlotBusy) as busy:
            switch.forget("A")
    finally:
        switch.release(lease)
    assert busy.value.retry_after == 1 and "waited 0 s" in str(busy.value)


def test_restored_hit_then_swap_keeps_counting_hits(tmp_path, fake):
    switch = make_switch(tmp_path)
    answer(switch, A, fake)
    answer(switch, B, fake)
    assert answer(switch, A, fake, 120, cache_n=100).cache == RESTORED
    sidecar = switch.store.read_sidecar(A.stem)
    assert (sidecar["hits"], sidecar["last_cache"], sidecar["last_cache_n"],
            sidecar["last_prompt_n"]) == (2, "restored", 100, 19)


# -- what a refused file records ---------------------------------------------------------
def test_the_fingerprint_format_stays_the_same_across_versions():
    """Sidecars on disk hold it: another format would refuse every saved file after an upgrade."""
    from kvproxy.slots.switch import fingerprint
    from tests.fake_llama import MODELS, PROPS
    assert fingerprint(PROPS, MODELS) == {"model_path": "/models/tiny.gguf", "model_size": 1000,
                                          "n_params": 135, "n_ctx": 8192, "build_info": "b1-test"}
    assert fingerprint({"n_ctx": 4096}, {}) == {"model_path": None, "model_size": None,
                                                "n_params": None, "n_ctx": 4096, "build_info": None}


def test_a_refused_file_says_why_in_log_sidecar_and_metrics(tmp_path, fake, caplog):
    switch = make_switch(tmp_path)
    answer(switch, A, fake)
    answer(switch, B, fake)
    made_by = SessionStore(tmp_path).read_sidecar(A.stem)["made_by"]
    fake.props["build_info"] = "b2-other"
    before = metric("kvproxy_restore_misses_total", reason="model_mismatch")
    with caplog.at_level(logging.WARNING, logger="kvproxy.switch"):
        assert switch.acquire(A).cache == MISS
    from kvproxy.slots.switch import fingerprint
    running = fingerprint(fake.props, fake.models)
    assert running == {**made_by, "build_info": "b2-other"}
    reason = f"made by {made_by}, running {running}"
    assert f"not restoring {A.stem}.bin: {reason}" in messages(caplog)
    sidecar = SessionStore(tmp_path).read_sidecar(A.stem)
    assert sidecar["refused"] == reason and sidecar["refused_at"]
    assert metric("kvproxy_restore_misses_total", reason="model_mismatch") == before + 1


def test_a_file_whose_sidecar_never_recorded_a_save_is_not_restored(tmp_path, fake, caplog):
    switch = make_switch(tmp_path)
    answer(switch, A, fake)              # A's sidecar exists (its answer), but A was never saved
    answer(switch, B, fake)
    store = SessionStore(tmp_path)
    store.update_sidecar(A.stem, {}, saved_at=None)
    store.bin_path(A.stem).write_bytes(b"ggsq" + bytes(50))
    before = metric("kvproxy_restore_misses_total", reason="model_mismatch")
    with caplog.at_level(logging.WARNING, logger="kvproxy.switch"):
        assert switch.acquire(A).cache == MISS
    assert f"not restoring {A.stem}.bin: it has no sidecar saying what made it" in messages(caplog)
    assert metric("kvproxy_restore_misses_total", reason="model_mismatch") == before


def test_restoring_comes_back_when_the_build_changes(tmp_path, fake):
    switch = make_switch(tmp_path, restore_miss_limit=1)
    fake.slot_token_ids = list(range(1000))
    answer(switch, A, fake, 500)
    answer(switch, B, fake, 500)
    answer(switch, A, fake, 510, cache_n=0,          # not honoured: switched off for b1-test
           prompt=FakePrompt(range(510)))
    lease = switch.acquire(B)
    switch.release(lease)
    assert lease.cache == MISS
    fake.props["build_info"] = "b2-new"              # another build: restoring is on again
    answer(switch, A, fake, 500)
    answer(switch, B, fake, 500)
    assert switch.acquire(A).cache == RESTORED


def test_a_restore_llama_server_recomputed_is_reported_and_counted_as_a_miss():
    """The header of a whole answer and the status page's hit ratio say what was reused."""
    from kvproxy.telemetry.activity import RecentActivity
    from kvproxy.slots.lease import Lease
    lease = Lease(A, RESTORED, restored_tokens=1800)
    assert lease.outcome({"cache_n": 0, "prompt_n": 1850}) == MISS
    assert lease.headers({"cache_n": 0, "prompt_n": 1850})["X-KVProxy-Cache"] == MISS
    assert lease.outcome({"cache_n": 1790, "prompt_n": 60}) == RESTORED
    assert lease.headers()["X-KVProxy-Cache"] == RESTORED, "a stream's headers go first"
    assert lease.outcome({"cache_n": 15, "prompt_n": 400}) == RESTORED, "it reused a part"
    assert Lease(A, RESTORED, restored_tokens=20).outcome({"cache_n": 0}) == RESTORED, \
        "too few tokens to judge"
    activity = RecentActivity()
    activity.record(lease, {"cache_n": 0, "prompt_n": 1850})
    activity.record(lease, {"cache_n": 1790, "prompt_n": 60})
    totals = activity.totals()
    assert totals["outcomes"]["miss"] == 1 and totals["outcomes"]["restored"] == 1
