"""The slot switch against a stubbed llama-server: swap sequence, files, lock bounds."""
import threading

import pytest

from kvproxy import create_app
from kvproxy.sessions.identity import Session, base_stem, client_key
from kvproxy.upstream.llama import LlamaClient
from kvproxy.storage.store import SessionStore
from kvproxy.slots.switch import BASE, HIT, MISS, RESTORED, SlotBusy, SlotSwitch, fingerprint_key
from tests.fake_llama import UPSTREAM, FakePrompt, MODEL, stem_of
from tests.support import timed_turn as turn, A, B


def make_switch(tmp_path, **kwargs):
    # Not the shipped default: these tests count the stub's slot actions one by one, and a
    # background save would add its own when its delay runs out (test_save_behind.py tests it).
    kwargs.setdefault("save_behind", False)
    return SlotSwitch(LlamaClient(UPSTREAM), SessionStore(tmp_path), **kwargs)


DEFAULT = Session("default", "default", persistent=False, model=MODEL)


def test_new_session_erases_and_same_session_does_nothing(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=False)
    assert turn(switch, A, fake).cache == MISS
    assert fake.actions == [("erase", None)]
    assert turn(switch, A, fake).cache == HIT
    assert fake.actions == [("erase", None)]


def test_switch_saves_old_and_restores_new(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=False)
    turn(switch, A, fake)
    turn(switch, B, fake)
    assert fake.actions[1:] == [("save", f"{A.stem}.saving.bin"), ("erase", None)]
    lease = turn(switch, A, fake)
    assert lease.cache == RESTORED and lease.restored_tokens == 12
    assert fake.actions[3:] == [("save", f"{B.stem}.saving.bin"), ("restore", f"{A.stem}.bin")]
    sidecar = switch.store.read_sidecar(A.stem)
    assert sidecar["session_id"] == "A" and sidecar["n_tokens"] == 12
    assert sidecar["made_by"]["model_path"] == "/models/tiny.gguf" and sidecar["hits"] == 2


def test_default_is_never_saved(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=False)
    turn(switch, DEFAULT, fake)
    turn(switch, A, fake)
    assert [a for a, _ in fake.actions] == ["erase", "erase"]
    assert not list(tmp_path.glob("*.bin")), "no slot file for default"


def test_no_restore_without_a_file(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=False)
    turn(switch, A, fake)
    turn(switch, B, fake)
    (tmp_path / f"{A.stem}.bin").unlink()
    assert turn(switch, A, fake).cache == MISS
    assert ("restore", f"{A.stem}.bin") not in fake.actions


def test_file_from_another_model_is_not_restored(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=False)
    turn(switch, A, fake)
    turn(switch, B, fake)
    fake.props = {**fake.props, "model_path": "/elsewhere/tiny.gguf"}
    assert turn(switch, A, fake).cache == MISS
    assert ("restore", f"{A.stem}.bin") not in fake.actions
    assert "/elsewhere/tiny.gguf" in SessionStore(tmp_path).read_sidecar(A.stem)["refused"]


def test_failed_restore_leaves_a_clean_slot(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=False)
    turn(switch, A, fake)
    turn(switch, B, fake)
    fake.fail_restore = True
    assert turn(switch, A, fake).cache == MISS
    assert fake.actions[-2:] == [("restore", f"{A.stem}.bin"), ("erase", None)]


def test_base_snapshot_holds_only_the_system_prompt_and_serves_new_sessions(tmp_path, fake):
    switch = make_switch(tmp_path)
    system = list(range(100))
    one = Session("one", "test", system_hash="cafe", model=MODEL)
    two = Session("two", "test", system_hash="cafe", model=MODEL)
    lease = switch.acquire(one, prompt=FakePrompt(system + [900, 901], system))
    assert lease.cache == MISS
    assert fake.prefills == [system], "the system prompt alone is computed first"
    assert fake.actions == [("erase", None), ("save", f"{base_stem('cafe', MODEL)}.saving.bin")]
    assert SessionStore(tmp_path).read_sidecar(base_stem("cafe", MODEL))["n_tokens"] == len(system)
    fake.tokens = 112
    switch.release(lease, {"cache_n": 99, "prompt_n": 3, "predicted_n": 10})
    lease = turn(switch, two, fake)
    assert lease.cache == BASE and lease.restored_tokens == len(system)
    assert fake.actions[-2:] == [("save", f"{one.stem}.saving.bin"), ("restore", f"{base_stem('cafe', MODEL)}.bin")]
    assert sum(1 for a in fake.actions if a == ("save", f"{base_stem('cafe', MODEL)}.saving.bin")) == 1


def test_llama_server_restart_is_noticed(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=False)
    turn(switch, A, fake)
    turn(switch, B, fake)
    turn(switch, A, fake)
    fake.tokens = 0  # llama-server restarted: the slot is empty
    lease = turn(switch, A, fake)
    assert lease.cache == RESTORED
    assert fake.actions[-1] == ("restore", f"{A.stem}.bin")
    assert fake.actions[-2][0] != "save", "an empty slot must not overwrite the session's file"


def test_unhonoured_restores_switch_restoring_off(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=False, restore_miss_limit=2)
    fake.slot_token_ids = list(range(1000))
    ignored = {"cache_n": 0, "prompt_n": 499, "predicted_n": 1}
    for session in (A, B):  # both get a saved file of 500 tokens
        lease = switch.acquire(session)
        fake.tokens = 500
        switch.release(lease, ignored)
    misses = []
    for session in (A, B):  # each restore reports 500 tokens, the answer reuses none
        lease = switch.acquire(session, prompt=FakePrompt(range(600)))
        assert lease.cache == RESTORED and lease.restored_tokens == 500
        switch.release(lease, ignored)
        misses.append(SessionStore(tmp_path).read_sidecar(session.stem).get("restore_not_honoured_at"))
    assert all(misses)
    assert switch.restore_check.status(fingerprint_key(switch.current_made_by()))["restoring_off"]
    assert switch.acquire(A).cache == MISS


def test_waiting_longer_than_the_bound_raises_busy(tmp_path, fake):
    switch = make_switch(tmp_path, lock_timeout=0.3)
    lease = switch.acquire(A)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(
        pytest.raises(SlotBusy, switch.acquire, B)))
    thread.start()
    thread.join(5)
    switch.release(lease)
    assert errors and errors[0].value.retry_after >= 1


def test_busy_slot_is_503_with_retry_after_in_openai_shape(tmp_path, fake):
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 0.2})
    switch = app.extensions["kvproxy.switch"]
    lease = switch.acquire(A)
    try:
        reply = app.test_client().post("/v1/chat/completions",
                                       json={"messages": [{"role": "user", "content": "hi"}]})
    finally:
        switch.release(lease)
    assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1
    assert reply.json["error"]["message"].startswith("the model is busy")


def test_slot_folder_is_kept_within_its_bound(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=False, max_disk_bytes=40)
    sessions = [Session(name, "test", model=MODEL) for name in ("s1", "s2", "s3", "s4")]
    for session in sessions:  # each saved file is 16 bytes
        turn(switch, session, fake)
    turn(switch, sessions[0], fake)  # s1 is used again: s2 is now the oldest
    store = SessionStore(tmp_path)
    on_disk = {s.id for s in sessions if store.has_bin(s.stem)}
    assert sum(store.bin_bytes(s.stem) for s in sessions) <= 40
    assert "s2" not in on_disk and {"s4"} <= on_disk
    assert store.read_sidecar(sessions[1].stem) is None


def test_base_from_another_model_is_replaced(tmp_path, fake):
    switch = make_switch(tmp_path)
    prompt = FakePrompt(range(60), list(range(50)))
    switch.release(switch.acquire(Session("one", "test", system_hash="cafe", model=MODEL), prompt=prompt))
    fake.props = {**fake.props, "model_path": "/elsewhere/tiny.gguf"}
    lease = switch.acquire(Session("two", "test", system_hash="cafe", model=MODEL), prompt=prompt)
    switch.release(lease)
    assert lease.cache == MISS
    sidecar = SessionStore(tmp_path).read_sidecar(base_stem("cafe", MODEL))
    assert sidecar["made_by"]["model_path"] == "/elsewhere/tiny.gguf"
    assert turn(switch, Session("three", "test", system_hash="cafe", model=MODEL), fake).cache == BASE


def test_whole_answer_holds_the_slot_until_the_reply_is_closed(tmp_path, fake):
    """The reply goes out first; the sidecar is written and the slot freed when it is closed."""
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False})
    switch = app.extensions["kvproxy.switch"]
    reply = app.test_client().post("/v1/chat/completions", headers={"X-Session-Id": "held"},
                                   json={"messages": [{"role": "user", "content": "hi"}]},
                                   buffered=False)
    assert reply.status_code == 200 and reply.json["choices"]
    stem = stem_of(client_key("held"))
    assert switch.lock.held_here()
    assert not (SessionStore(tmp_path).read_sidecar(stem) or {}).get("hits")
    reply.close()
    assert not switch.lock.held_here()
    assert SessionStore(tmp_path).read_sidecar(stem)["hits"] == 1


def test_a_failing_hook_after_the_answer_does_not_keep_the_slot(tmp_path, fake):
    """The answer's response is replaced by an error page and never closed: the slot is freed."""
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 1})
    switch = app.extensions["kvproxy.switch"]
    failing = [True]

    @app.after_request
    def broken_hook(response):
        if failing.pop():
            raise RuntimeError("a bug in a hook")
        return response

    client = app.test_client()
    body = {"messages": [{"role": "user", "content": "hi"}]}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 500 and reply.json["error"]["code"] == 500
    assert not switch.lock.held_here()
    failing.append(False)
    assert client.post("/v1/chat/completions", json=body).status_code == 200
