"""The disk side against a stubbed llama-server: checked saves, quarantine, sweep, budget."""
import errno
import json
import logging
import os
from pathlib import Path

import pytest

from kvproxy import create_app
from kvproxy.storage import budget, checked_save, quarantine, sweep, store as store_module
from kvproxy.storage.budget import Entry, plan_eviction
from kvproxy.sessions.identity import Session, base_stem
from kvproxy.storage.store import SIDECAR_FORMAT, SessionStore, StorageError
from kvproxy.slots.switch import BASE, HIT, MISS, RESTORED
from tests.fake_llama import UPSTREAM, FakePrompt, make_switch, MODEL
from tests.support import metric, turn, A, B

OPENAI_BODY = {"messages": [{"role": "user", "content": "hi"}]}


def shutil_usage(total, free):
    import shutil
    return shutil._ntuple_diskusage(total, total - free, free)


def state_names(tmp_path):
    return SessionStore(tmp_path).read_state().get("active")


# -- a save never replaces a good file with a bad one -------------------------
@pytest.mark.parametrize("fault", ["short", "fail"])
def test_a_failed_save_keeps_the_old_file_and_the_swap_goes_ahead(tmp_path, fake, fault):
    """The session leaving the slot loses only its newest turns: its old file still matches
    its sidecar and restores; the swap is not refused."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)
    turn(switch, A, fake, tokens=40)          # A's file holds 12 tokens; the slot now 40
    good = (tmp_path / f"{A.stem}.bin").read_bytes()
    dropped = metric("kvproxy_saves_dropped_total", kind="session")
    fake.save_fault = fault
    lease = turn(switch, B, fake)
    assert (lease.cache, lease.restored_tokens) == (RESTORED, 12)
    assert (tmp_path / f"{A.stem}.bin").read_bytes() == good
    assert quarantine.size_problem(switch.store, A.stem, switch.store.read_sidecar(A.stem)) is None
    assert not list(tmp_path.glob("*.saving.bin")), "the temporary file is removed"
    assert metric("kvproxy_saves_dropped_total", kind="session") == dropped + 1
    assert switch.budget.dropped.count == 1 and switch.budget.dropped.last["session_id"] == "A"
    assert "dropped" in switch.budget.problem()
    fake.save_fault = None
    lease = turn(switch, A, fake)
    assert (lease.cache, lease.restored_tokens) == (RESTORED, 12), "A's older state"


def full_disk_on(suffix, monkeypatch):
    """os.replace in the slot folder fails with ENOSPC for names ending in ``suffix``."""
    real_replace = os.replace

    def full_disk(src, dst):
        if str(src).endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)
    monkeypatch.setattr(checked_save.os, "replace", full_disk)


CLIENTS = (("/v1/chat/completions", OPENAI_BODY, "openai"),
           ("/v1/messages", {**OPENAI_BODY, "model": "m", "max_tokens": 5}, "anthropic"),
           ("/api/chat", {**OPENAI_BODY, "model": "tiny", "stream": False}, "ollama"))


def test_a_save_the_disk_cannot_take_still_answers_every_api(tmp_path, fake, monkeypatch):
    """A full disk during the save of the outgoing session: each session still gets its
    answer, and /health and /api/status say what is wrong (degraded, not down)."""
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False,
                      "min_free_gb": 0})
    client = app.test_client()
    assert client.get("/health").json["status"] == "ok"
    full_disk_on(".saving.bin", monkeypatch)
    for session in ("a", "b", "a", "b"):
        for path, body, shape in CLIENTS:
            reply = client.post(path, json=body, headers={"X-Session-Id": session})
            assert reply.status_code == 200, (session, shape, reply.json)
    assert not list(tmp_path.glob("*.bin")), "nothing could be saved"
    health = client.get("/health")
    assert health.status_code == 200 and health.json["status"] == "degraded"
    assert "No space left on device" in health.json["disk"]
    shown = client.get("/api/status").json["disk"]
    assert shown["saves_dropped"] == 3 and shown["last_dropped"]["session_id"] == "a"
    assert "No space left on device" in shown["problem"]


def test_a_state_file_that_cannot_be_written_is_503_in_the_clients_format(tmp_path, fake,
                                                                         monkeypatch):
    """A disk too full even for the state file: the swap cannot claim the slot, and says so
    in the client's format; the session in the slot keeps its cache."""
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False,
                      "min_free_gb": 0})
    client = app.test_client()
    assert client.post("/v1/chat/completions", json=OPENAI_BODY,
                       headers={"X-Session-Id": "a"}).status_code == 200
    full_disk_on(".tmp", monkeypatch)   # every JSON write goes through a temporary file
    for path, body, shape in CLIENTS:
        reply = client.post(path, json=body, headers={"X-Session-Id": "b"})
        assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1
        message = {"openai": lambda j: j["error"]["message"],
                   "anthropic": lambda j: j["error"]["message"] if j["type"] == "error" else None,
                   "ollama": lambda j: j["error"]}[shape](reply.json)
        assert "No space left on device" in message and "slot folder" in message, message
        again = client.post("/v1/chat/completions", json=OPENAI_BODY,
                            headers={"X-Session-Id": "a"})
        assert again.headers["X-KVProxy-Cache"] == "hit", "the untouched slot stays trusted"
    assert state_names(tmp_path) == "a"
    assert not list(tmp_path.glob("*.saving.bin"))


def test_a_sidecar_that_cannot_be_written_keeps_file_and_sidecar_together(tmp_path, fake,
                                                                          monkeypatch):
    """A save's new sidecar is written before its file is renamed in: a full disk at that
    point leaves the old pair, which still restores; the swap goes ahead."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)
    turn(switch, A, fake, tokens=40)
    good = (tmp_path / f"{A.stem}.bin").read_bytes()

    def no_space(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checked_save, "write_json_beside", no_space)
    assert turn(switch, B, fake).cache == RESTORED
    monkeypatch.undo()
    assert (tmp_path / f"{A.stem}.bin").read_bytes() == good
    assert SessionStore(tmp_path).read_sidecar(A.stem)["saved_bytes"] == len(good)
    assert "No space left" in switch.budget.dropped.last["reason"]
    lease = turn(switch, A, fake)
    assert (lease.cache, lease.restored_tokens) == (RESTORED, 12)


def test_a_sidecar_rename_that_fails_removes_file_and_sidecar_together(tmp_path, fake,
                                                                       monkeypatch):
    """The new file is renamed in, its sidecar's rename fails: the old sidecar does not
    describe the new file, so both go, and the session starts afresh."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)
    turn(switch, A, fake, tokens=40)
    real_replace = os.replace

    def sidecar_rename_fails(src, dst):
        if Path(dst) == switch.store.sidecar_path(A.stem):
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(checked_save.os, "replace", sidecar_rename_fails)
    assert turn(switch, B, fake).cache == RESTORED
    monkeypatch.undo()
    assert not switch.store.has_bin(A.stem) and switch.store.read_sidecar(A.stem) is None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".saving.bin"))]
    assert turn(switch, A, fake).cache == MISS


def test_an_empty_slot_never_replaces_a_saved_file(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)
    good = (tmp_path / f"{A.stem}.bin").read_bytes()
    fake.tokens = 0
    assert switch.executor.save("A", A.stem, switch.current_made_by(), "session", None,
                                slot=0, tokens=12) is None
    assert (tmp_path / f"{A.stem}.bin").read_bytes() == good


def test_the_state_never_names_a_session_the_slot_does_not_hold(tmp_path, fake, monkeypatch):
    """The state file cannot be written after the slot changed: it must not still say A."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    real_write = store_module.write_json_atomic
    state_writes = []

    def failing_final_state_write(path, data):
        if path.name == store_module.STATE_FILE:
            entry = data["slots"]["0"]
            state_writes.append(entry.get("active"))
            # The claim (B, unproven) goes through; the write saying B is in the slot, made
            # with the request's bookkeeping after the answer, fails.
            if entry.get("active") == "B" and entry.get("phase") in ("ours", "unsaved"):
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, data)

    monkeypatch.setattr(store_module, "write_json_atomic", failing_final_state_write)
    lease = switch.acquire(B)
    assert fake.actions[-1] == ("erase", None), "the slot changed"
    switch.release(lease, {"cache_n": 0, "prompt_n": 5, "predicted_n": 2})  # logged, not raised
    assert state_writes[-1] == "B", "the record was tried, and refused"
    assert state_names(tmp_path) != "A"
    monkeypatch.setattr(store_module, "write_json_atomic", real_write)
    lease = switch.acquire(A)
    assert lease.cache == RESTORED, "an unknown slot is restored, never trusted"
    switch.release(lease)


def test_a_swap_that_fails_before_the_slot_changes_keeps_it_trusted(tmp_path, fake,
                                                                    monkeypatch):
    """The disk is full for the whole swap: the state file cannot be written, so the swap
    cannot claim the slot. Nothing touched the slot: its session is still a hit."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    real_write = store_module.write_json_atomic

    def state_file_full(path, data):
        if path.name == store_module.STATE_FILE:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, data)

    monkeypatch.setattr(store_module, "write_json_atomic", state_file_full)
    before = len(fake.actions)
    with pytest.raises(StorageError):
        switch.acquire(B)
    assert [action for action, _ in fake.actions[before:]] == ["save"]
    lease = switch.acquire(A)
    assert lease.cache == HIT, "the slot still holds A"
    switch.release(lease)
    monkeypatch.setattr(store_module, "write_json_atomic", real_write)
    assert state_names(tmp_path) == "A"


def test_a_swap_that_fails_after_the_claim_but_before_the_slot_changes_undoes_it(
        tmp_path, fake, monkeypatch):
    """The claim is written, then the refusal of a bad file cannot be recorded: the claim is
    undone, the slot still holds its session and stays trusted."""
    switch = make_switch(tmp_path)
    turn(switch, B, fake)
    turn(switch, A, fake)                       # B's file saved
    sidecar = switch.store.sidecar_path(B.stem)
    data = json.loads(sidecar.read_text())
    data["made_by"] = {"model_path": "another"}  # refused and recorded in the sidecar
    sidecar.write_text(json.dumps(data))

    def refuse_fails(stem, defaults, **changes):
        raise StorageError("cannot write the sidecar: No space left on device")

    monkeypatch.setattr(switch.store, "update_sidecar", refuse_fails)
    with pytest.raises(StorageError):
        switch.acquire(B)
    monkeypatch.undo()
    assert state_names(tmp_path) == "A" and switch.table.get(0).trusted
    lease = switch.acquire(A)
    assert lease.cache == HIT
    switch.release(lease)


# -- files that do not match their sidecar -----------------------------------
def test_a_file_whose_size_does_not_match_is_moved_aside_not_restored(tmp_path, fake, caplog):
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)
    path = tmp_path / f"{A.stem}.bin"
    path.write_bytes(path.read_bytes()[:-5])  # a torn write
    bad_files_before = metric("kvproxy_restore_misses_total", reason="bad_file")
    with caplog.at_level(logging.WARNING, "kvproxy"):
        lease = turn(switch, A, fake)
    assert lease.cache == MISS
    assert ("restore", f"{A.stem}.bin") not in fake.actions
    moved = list((tmp_path / "quarantine").glob(f"{A.stem}.*.bin"))
    assert len(moved) == 1 and not path.exists()
    reason = json.loads(moved[0].with_suffix(".json").read_text())["quarantine_reason"]
    assert "sidecar says 16" in reason
    assert metric("kvproxy_restore_misses_total", reason="bad_file") == bad_files_before + 1
    assert any("not restoring" in r.message and "sidecar says 16" in r.message for r in caplog.records)


def test_a_format_1_sidecar_still_loads_and_restores(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)
    sidecar_path = tmp_path / f"{A.stem}.json"
    old = json.loads(sidecar_path.read_text())
    old["format"] = 1
    del old["saved_bytes"]          # format 1 knew only llama-server's n_bytes
    sidecar_path.write_text(json.dumps(old))
    assert SessionStore(tmp_path).read_sidecar(A.stem)["format"] == SIDECAR_FORMAT
    assert {s["stem"] for s in SessionStore(tmp_path).sidecars()} >= {A.stem}
    assert turn(switch, A, fake).cache == RESTORED
    switch.store.notes.flush()      # what the answer taught the sidecar, held until now
    assert json.loads(sidecar_path.read_text())["format"] == SIDECAR_FORMAT


def test_unknown_or_newer_formats_are_not_sidecars():
    assert store_module.migrate_sidecar({"active": "x"}) is None     # the state file
    assert store_module.migrate_sidecar({"format": 99, "stem": "x"}) is None
    assert store_module.migrate_sidecar({"format": 1, "stem": "x", "saved_at": "t", "n_bytes": 7}
                                        )["saved_bytes"] == 7


# -- start-up sweep ------------------------------------------------------------
def test_sweep_removes_leftovers_and_moves_orphans_aside(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)                       # A saved, with its sidecar
    turn(switch, Session("C", "test", model=MODEL), fake)   # B saved
    (tmp_path / f"{A.stem}.saving.bin").write_bytes(b"half")
    (tmp_path / "probe.0123456789abcdef.bin").write_bytes(b"ggsq")
    (tmp_path / f".{A.stem}.json.x1y2.tmp").write_text("{")
    (tmp_path / "stray.bin").write_bytes(b"not ours")
    (tmp_path / f"{B.stem}.bin").unlink()      # B's sidecar now claims a file that is gone
    done = sweep.sweep(SessionStore(tmp_path))
    names = {p.name for p in tmp_path.iterdir()}
    assert f"{A.stem}.bin" in names and f"{A.stem}.json" in names, "a good file stays"
    assert not {f"{A.stem}.saving.bin", "probe.0123456789abcdef.bin", f".{A.stem}.json.x1y2.tmp",
                "stray.bin", f"{B.stem}.json"} & names
    assert list((tmp_path / "quarantine").glob("stray.*.bin"))
    assert len(done) == 5 and any("stray.bin" in line and "no sidecar" in line for line in done)
    assert SessionStore(tmp_path).read_sidecar(Session("C", "test", model=MODEL).stem) is not None, \
        "a sidecar that never had a file (only request counts) stays"


def test_start_up_sweeps_with_the_slot_locked_and_logs(tmp_path, fake, caplog):
    from kvproxy.ops.startup import check_at_start
    (tmp_path / "stray.bin").write_bytes(b"x")
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM})
    with caplog.at_level(logging.INFO, "kvproxy"):
        check_at_start(app)
    assert not (tmp_path / "stray.bin").exists()
    assert any("start-up sweep: moved stray.bin" in r.message for r in caplog.records)


# -- the disk budget -------------------------------------------------------------
def entry(name, size, used, loose=False):
    return Entry(path=Path(name), size=size, used=used,
                 stem=None if loose else name, loose=loose)


def test_plan_evicts_loose_files_first_then_least_recently_used():
    entries = [entry("new", 10, "3"), entry("old", 10, "1"), entry("orphan", 10, "9", loose=True)]
    victims, fits = plan_eviction(entries, total=30, incoming=10, replacing=0, free=None,
                                  max_bytes=25, min_free=0)
    assert fits and [v.path.name for v in victims] == ["orphan", "old"]


def test_plan_keeps_the_free_space_reserve_or_deletes_nothing():
    entries = [entry("a", 10, "1"), entry("b", 10, "2")]
    victims, fits = plan_eviction(entries, total=20, incoming=10, replacing=0, free=15,
                                  max_bytes=0, min_free=10)
    assert fits and [v.path.name for v in victims] == ["a"]
    victims, fits = plan_eviction(entries, total=20, incoming=10, replacing=0, free=5,
                                  max_bytes=0, min_free=30)
    assert not fits and victims == []


def test_eviction_happens_before_the_save(tmp_path, fake):
    switch = make_switch(tmp_path, max_disk_bytes=40)
    sizes_at_save = []
    fake.on_save = lambda name: sizes_at_save.append(
        sum(p.stat().st_size for p in tmp_path.glob("*.bin")) + fake.tokens + 4)
    for name in ("s1", "s2", "s3", "s4", "s5"):  # each file is 16 bytes
        turn(switch, Session(name, "test", model=MODEL), fake)
    assert sizes_at_save and max(sizes_at_save) <= 40


def test_a_session_whose_slot_holds_nothing_costs_no_other_file(tmp_path, fake):
    """Its request ended before the slot held a token: the save that swaps it out writes
    nothing, so it makes no room either, even in a folder full to its bound."""
    switch = make_switch(tmp_path, max_disk_bytes=32)
    for name in ("s1", "s2"):
        turn(switch, Session(name, "test", model=MODEL), fake)
    switch.release(switch.acquire(A))            # s2 saved: two 16-byte files, the bound
    assert fake.tokens == 0, "cut before any token: no timings, the slot empty"
    turn(switch, B, fake)                        # A swapped out: its save writes nothing
    assert ("save", f"{A.stem}.saving.bin") in fake.actions
    assert {p.stem for p in tmp_path.glob("*.bin")} == {Session(n, "test", model=MODEL).stem
                                                        for n in ("s1", "s2")}


def test_room_for_a_base_snapshot_is_made_before_it_is_saved(tmp_path, fake):
    """The base's size is estimated from its own tokens (the slot's record says nothing yet)."""
    switch = make_switch(tmp_path, base_snapshots=True, max_disk_bytes=64)
    sizes_at_save = []
    fake.on_save = lambda name: sizes_at_save.append(
        (name, sum(p.stat().st_size for p in tmp_path.glob("*.bin")) + fake.tokens + 4))
    for name in ("s1", "s2", "s3"):                  # 16-byte files: s1 and s2 saved
        turn(switch, Session(name, "test", model=MODEL), fake)
    system = list(range(32))
    lease = turn(switch, Session("new", "test", system_hash="cafe", model=MODEL), fake,
                 prompt=FakePrompt(system + [900, 901], system))   # s3 saved, then the base
    assert lease.cache == MISS and (tmp_path / f"{base_stem('cafe', MODEL)}.bin").stat().st_size == 36
    (base_save,) = [size for name, size in sizes_at_save if name.startswith(base_stem("cafe", MODEL))]
    assert base_save <= 64, "the folder went over its bound while the base was written"


def test_a_session_saved_over_its_own_file_needs_room_only_for_its_growth(tmp_path, fake):
    switch = make_switch(tmp_path, max_disk_bytes=56)
    C = Session("C", "test", model=MODEL)
    for session in (C, A, B, A):         # C's, A's and B's files: 48 of 56 bytes
        turn(switch, session, fake)
    turn(switch, Session("D", "test", model=MODEL), fake)   # A saved again over its own 16 bytes: still 48
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == sorted(
        f"{s.stem}.bin" for s in (A, B, C))


def test_room_is_estimated_from_files_of_the_running_model(tmp_path, fake):
    """Files another model made (here six times as large per token) say nothing about the
    size of this model's next save: no file is evicted for room that is not needed."""
    switch = make_switch(tmp_path, max_disk_bytes=100)
    turn(switch, A, fake)
    turn(switch, B, fake)                                   # A saved: 16 bytes for 12 tokens
    store = SessionStore(tmp_path)
    (tmp_path / "other-model.bin").write_bytes(bytes(60))
    store.update_sidecar("other-model", {"session_id": "old", "kind": "session"},
                         made_by={"model": "another"}, n_tokens=10, saved_bytes=60,
                         saved_at="2000-01-01T00:00:00+00:00")
    turn(switch, A, fake)                                   # B saved: 12 tokens, about 16 bytes
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == sorted(
        [f"{A.stem}.bin", f"{B.stem}.bin", "other-model.bin"])


def test_orphans_count_toward_the_bound_and_go_first(tmp_path, fake):
    switch = make_switch(tmp_path, max_disk_bytes=40)
    turn(switch, A, fake)
    turn(switch, B, fake)                       # A: 16 bytes
    (tmp_path / "stray.bin").write_bytes(bytes(20))
    turn(switch, A, fake)                       # saving B (16) would make 52 > 40
    assert not (tmp_path / "stray.bin").exists()
    assert (tmp_path / f"{A.stem}.bin").exists() and (tmp_path / f"{B.stem}.bin").exists()


def test_eviction_spares_the_incoming_session_and_its_base(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=True, max_disk_bytes=96)
    old = Session("old", "test", system_hash="cafe", model=MODEL)
    system = list(range(32))
    turn(switch, old, fake, tokens=40, prompt=FakePrompt(system + [900, 901], system))  # base.cafe saved (36)
    assert (tmp_path / f"{base_stem('cafe', MODEL)}.bin").stat().st_size == 36
    for name in ("s1", "s2"):
        turn(switch, Session(name, "test", model=MODEL), fake)        # old (44), s1 (16) saved: 96
    # Back to old: saving s2 needs room; old's file and base.cafe are the least recently used.
    lease = turn(switch, old, fake)
    assert lease.cache == RESTORED
    assert (tmp_path / f"{base_stem('cafe', MODEL)}.bin").exists()
    assert not (tmp_path / f"{Session('s1', 'test', model=MODEL).stem}.bin").exists()
    new = turn(switch, Session("new", "test", system_hash="cafe", model=MODEL), fake)
    assert new.cache == BASE


def test_free_space_reserve_evicts_or_refuses(tmp_path, fake, monkeypatch):
    switch = make_switch(tmp_path, min_free_bytes=100)
    for name in ("s1", "s2", "s3"):
        turn(switch, Session(name, "test", model=MODEL), fake)        # s1, s2 saved: 16 bytes each
    free = {"bytes": 110}
    monkeypatch.setattr(switch.budget, "free_bytes", lambda: free["bytes"])
    turn(switch, Session("s4", "test", model=MODEL), fake)           # saving s3 (~16) needs 116 free: evict s1
    assert not (tmp_path / f"{Session('s1', 'test', model=MODEL).stem}.bin").exists()
    assert (tmp_path / f"{Session('s2', 'test', model=MODEL).stem}.bin").exists()
    free["bytes"] = 10
    before = sorted(p.name for p in tmp_path.glob("*.bin"))
    turn(switch, Session("s5", "test", model=MODEL), fake)          # s4's save is dropped, s5 gets the slot
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == before, "nothing deleted or saved"
    assert state_names(tmp_path) == "s5"
    assert "KVPROXY_MIN_FREE_GB" in switch.budget.dropped.last["reason"]


def test_the_free_space_kept_is_at_most_a_tenth_of_a_small_disk(tmp_path, fake, monkeypatch):
    """KVPROXY_MIN_FREE_GB=1 on a 100 MB disk with 50 MB free: saves go on (10 MB kept free)."""
    switch = make_switch(tmp_path, min_free_bytes=budget.GB)
    usage = {"free": 50 * budget.MB, "total": 100 * budget.MB}
    monkeypatch.setattr(budget.shutil, "disk_usage",
                        lambda path: shutil_usage(usage["total"], usage["free"]))
    assert switch.budget.floor() == 10 * budget.MB
    turn(switch, A, fake)
    turn(switch, B, fake)
    assert switch.store.has_bin(A.stem) and switch.budget.dropped.count == 0
    assert switch.budget.problem() is None
    usage["free"] = 9 * budget.MB                       # below the floor: reported
    assert "less than the 10 MB kept free" in switch.budget.problem()


def test_estimate_uses_bytes_per_token_of_earlier_saves(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake, tokens=96)                    # file: 100 bytes for 96 tokens
    turn(switch, B, fake, tokens=46)
    assert switch.budget.estimate(A.stem, 192, None) == 200
    assert switch.budget.estimate("someone-else", 480, switch.current_made_by()) == 500


def test_sweep_deletes_a_sidecar_without_a_file_once_it_serves_no_session(tmp_path):
    """A sidecar without a save keeps a session's counts and trail while the session is used;
    one that names no session (written about a file since gone) or whose session has been
    idle past the bound is deleted, not kept forever."""
    from datetime import datetime, timedelta, timezone
    store = SessionStore(tmp_path)
    now = datetime.now(timezone.utc)

    def sidecar(stem, **fields):
        store_module.write_json_atomic(store.sidecar_path(stem), {
            "format": SIDECAR_FORMAT, "stem": stem, "created_at": now.isoformat(), **fields})
    sidecar("refused-gone", hits=0, refused="it has 3 bytes, its sidecar says 9")
    sidecar("in-use", session_id="u", hits=3, last_used_at=(now - timedelta(days=2)).isoformat())
    sidecar("idle", session_id="i", hits=3, last_used_at=(now - timedelta(days=sweep.IDLE_SIDECAR_DAYS + 1))
            .isoformat())
    done = sweep.sweep(store)
    assert {p.stem for p in tmp_path.glob("*.json")} == {"in-use"}
    assert sorted(done) == [
        f"deleted idle.json: its session has no file and was last used "
        f"{sweep.IDLE_SIDECAR_DAYS + 1} days ago",
        "deleted refused-gone.json: it records neither a save nor a session"]
