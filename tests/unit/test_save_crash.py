"""A save killed at each of its steps: after the start-up sweep the session restores its newest
complete state, and every file matches its sidecar (stubbed llama-server).

Each crash runs in a child process that saves a session and kills itself with SIGKILL at one
step, so nothing of kvproxy's own clean-up runs, as after ``kill -9`` or a power cut (for
what the page cache kept).
"""
import os
import subprocess
import sys

import pytest
import responses

from kvproxy.launch.processes import REPO_ROOT
from kvproxy.sessions.identity import Session
from kvproxy.slots.switch import RESTORED
from kvproxy.storage import checked_save, quarantine, sweep
from kvproxy.storage.store import SessionStore
from tests.fake_llama import FakeLlama, make_switch, MODEL

A = Session("A", "test", system_hash="aaaa", model=MODEL)
OLD, NEW = 12, 40   # tokens of A's file before the save, and of the slot it saves

CHILD = r"""
import os, signal, sys
from pathlib import Path
import responses
from kvproxy.storage import checked_save, quarantine, sweep
from kvproxy.sessions.identity import Session
from tests.fake_llama import MODEL, FakeLlama, make_switch

slot_dir, point, companion = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
A = Session("A", "test", system_hash="aaaa", model=MODEL)
B = Session("B", "test", system_hash="bbbb", model=MODEL)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def turn(switch, session, fake, tokens):
    lease = switch.acquire(session)
    fake.tokens = tokens
    switch.release(lease, {"cache_n": 0, "prompt_n": tokens, "predicted_n": 0})


with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
    fake = FakeLlama(mock, slot_dir)
    fake.companion = companion[0] if companion else None   # newer llama-server's <file>.ckpt
    switch = make_switch(slot_dir)
    turn(switch, A, fake, {old})
    turn(switch, B, fake, {old})
    turn(switch, A, fake, {new})          # A's file holds {old} tokens, the slot {new}
    sidecar = switch.store.sidecar_path(A.stem)
    real_beside, real_replace = checked_save.write_json_beside, os.replace

    def beside(path, data):
        if point == "after the temporary file" and path == sidecar:
            die()
        written = real_beside(path, data)
        if point == "after the sidecar write" and path == sidecar:
            die()
        return written

    def replace(src, dst):
        real_replace(src, dst)
        if point == "after the file's rename" and str(src).endswith(".saving.bin"):
            die()
        if point == "after the companion's rename" and str(src).endswith(".saving.bin.ckpt"):
            die()
        if point == "after the sidecar's rename" and Path(dst) == sidecar:
            die()

    if point == "before the temporary file":
        fake.on_save = lambda name: die()
    checked_save.write_json_beside = beside
    os.replace = replace
    switch.acquire(B)                     # saves A: killed at the crash point
    print("saved")
""".replace("{old}", str(OLD)).replace("{new}", str(NEW))

# crash point -> tokens of the newest complete state of A
POINTS = {
    "before the temporary file": OLD,
    "after the temporary file": OLD,     # written and checked, but no sidecar says so
    "after the sidecar write": NEW,      # both written under temporary names: rolled forward
    "after the file's rename": NEW,      # the new file in place, its sidecar not yet
    "after the sidecar's rename": NEW,
    "not at all": NEW,
}


# with a companion file beside the slot file (newer llama-server's context checkpoints)
COMPANION_POINTS = {**POINTS, "after the companion's rename": NEW}


def crash_save(slot_dir, point, *companion):
    result = subprocess.run([sys.executable, "-c", CHILD, str(slot_dir), point, *companion],
                            cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    return result


@pytest.mark.parametrize("point", list(POINTS))
def test_a_save_killed_at_any_step_restores_the_newest_complete_state(tmp_path, point):
    result = crash_save(tmp_path, point)
    if point == "not at all":
        assert result.returncode == 0 and "saved" in result.stdout, result.stderr
    else:
        assert result.returncode == -9, result.stderr
    store = SessionStore(tmp_path)
    done = sweep.sweep(store)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.endswith((".saving.bin", ".tmp"))], names
    assert not (tmp_path / "quarantine").exists(), (done, names)
    for sidecar in store.sidecars():
        if sidecar.get("saved_at"):
            assert quarantine.size_problem(store, sidecar["stem"], sidecar) is None, (sidecar, names)
    assert store.read_sidecar(A.stem)["n_tokens"] == POINTS[point], done
    # A fresh process over the folder: llama-server has lost the slot, A comes from its file.
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path)
        switch = make_switch(tmp_path)
        lease = switch.acquire(A)
        switch.release(lease, {})
    assert (lease.cache, lease.restored_tokens) == (RESTORED, POINTS[point])


def test_a_temporary_sidecar_that_does_not_match_is_rolled_back(tmp_path, fake):
    """A temporary sidecar whose size matches neither the saving file nor the slot file is
    deleted with the saving file; the old pair stays and restores."""
    switch = make_switch(tmp_path)
    for session, tokens in ((A, OLD), (Session("B", "test", model=MODEL), OLD)):
        lease = switch.acquire(session)
        fake.tokens = tokens
        switch.release(lease, {"cache_n": 0, "prompt_n": tokens, "predicted_n": 0})
    store = SessionStore(tmp_path)
    (tmp_path / f"{A.stem}.saving.bin").write_bytes(b"ggsq" + bytes(NEW - 1))   # cut short
    written = dict(store.read_sidecar(A.stem), n_tokens=NEW, saved_bytes=NEW + 4)
    checked_save.write_json_beside(store.sidecar_path(A.stem), written)
    done = sweep.sweep(store)
    assert not any("finished" in line for line in done), done
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(A.stem)) == \
        [f"{A.stem}.bin", f"{A.stem}.json"]
    assert store.read_sidecar(A.stem)["n_tokens"] == OLD
    assert os.path.getsize(store.bin_path(A.stem)) == OLD + 4


@pytest.mark.parametrize("point", list(COMPANION_POINTS))
def test_a_save_with_a_companion_killed_at_any_step_keeps_file_and_companion_together(
        tmp_path, point):
    """The companion (``<file>.ckpt``) after the sweep is the one saved with the file in place:
    the restore finds the checkpoints of the state it restores."""
    result = crash_save(tmp_path, point, ".ckpt")
    assert result.returncode == (0 if point == "not at all" else -9), result.stderr
    store = SessionStore(tmp_path)
    done = sweep.sweep(store)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if ".saving.bin" in n or n.endswith(".tmp")], names
    assert not (tmp_path / "quarantine").exists(), (done, names)
    assert quarantine.size_problem(store, A.stem, store.read_sidecar(A.stem)) is None, (done, names)
    assert store.read_sidecar(A.stem)["companions"] == {".ckpt": 4 + 2 * COMPANION_POINTS[point]}
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path)
        fake.companion = ".ckpt"
        switch = make_switch(tmp_path)
        lease = switch.acquire(A)
        switch.release(lease, {})
    assert (lease.cache, lease.restored_tokens) == (RESTORED, COMPANION_POINTS[point])
    assert fake.restored_companions == [COMPANION_POINTS[point]], "its own checkpoints"
