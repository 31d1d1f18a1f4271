"""Companion files: newer llama-server saves a slot's context checkpoints beside its file
(``<stem>.bin.ckpt``). Checked saves, renames, quarantine, the start-up sweep, eviction and
deletion carry them with their file (stubbed llama-server writing a ``.ckpt`` on every save)."""
import json
import logging

import pytest

from kvproxy.ops.metrics import slot_folder_usage
from kvproxy.sessions.identity import Session, file_stem
from kvproxy.slots.switch import RESTORED
from kvproxy.storage import checked_save, quarantine, sweep, model_names
from kvproxy.storage.store import SessionStore, bytes_with_companions, companion_index
from tests.fake_llama import MODEL, make_switch, stem_of

A = Session("A", "test", system_hash="aaaa", model=MODEL)
B = Session("B", "test", system_hash="bbbb", model=MODEL)
CKPT = ".ckpt"


def turn(switch, session, fake, tokens=12):
    lease = switch.acquire(session)
    fake.tokens = tokens
    switch.release(lease, {"cache_n": lease.restored_tokens,
                           "prompt_n": tokens - lease.restored_tokens, "predicted_n": 0})
    return lease


def ckpt_tokens(path):
    """The tokens the stub's companion file was saved with."""
    return (path.stat().st_size - 4) // 2


@pytest.fixture
def ckpt_fake(fake):
    fake.companion = CKPT
    return fake


def saved_a(tmp_path, fake, tokens=12, **kwargs):
    """A switch whose folder holds A's file (``tokens``) and companion; B in the slot."""
    switch = make_switch(tmp_path, **kwargs)
    turn(switch, A, fake, tokens)
    turn(switch, B, fake)
    return switch


# -- checked saves -------------------------------------------------------------------
def test_a_checked_save_puts_the_companion_beside_the_file_and_the_restore_finds_it(
        tmp_path, ckpt_fake):
    switch = saved_a(tmp_path, ckpt_fake)
    companion = tmp_path / f"{A.stem}.bin{CKPT}"
    assert companion.is_file() and ckpt_tokens(companion) == 12
    assert not list(tmp_path.glob("*.saving.bin*")), "nothing left under the temporary name"
    assert switch.store.read_sidecar(A.stem)["companions"] == {CKPT: 4 + 2 * 12}
    lease = turn(switch, A, ckpt_fake, tokens=40)
    assert (lease.cache, lease.restored_tokens) == (RESTORED, 12)
    assert ckpt_fake.restored_companions[-1] == 12, "the restore found A's checkpoints"
    turn(switch, B, ckpt_fake)                          # A saved again: 40 tokens
    assert ckpt_tokens(companion) == 40, "the new companion replaced the old one"
    assert switch.store.read_sidecar(A.stem)["companions"] == {CKPT: 4 + 2 * 40}
    lease = turn(switch, A, ckpt_fake)
    assert (lease.cache, lease.restored_tokens, ckpt_fake.restored_companions[-1]) == \
        (RESTORED, 40, 40)


def test_a_save_without_a_companion_removes_the_old_files_companion(tmp_path, ckpt_fake):
    """A companion of the replaced file would not match the new one."""
    switch = saved_a(tmp_path, ckpt_fake)
    turn(switch, A, ckpt_fake, tokens=40)
    ckpt_fake.companion = None                       # llama-server wrote none this time
    turn(switch, B, ckpt_fake)
    assert not (tmp_path / f"{A.stem}.bin{CKPT}").exists()
    assert switch.store.read_sidecar(A.stem)["companions"] == {}
    assert quarantine.size_problem(switch.store, A.stem, switch.store.read_sidecar(A.stem)) is None


def test_a_failed_save_removes_its_temporary_companion_and_keeps_the_old_one(
        tmp_path, ckpt_fake):
    switch = saved_a(tmp_path, ckpt_fake)
    turn(switch, A, ckpt_fake, tokens=40)
    ckpt_fake.save_fault = "short"
    turn(switch, B, ckpt_fake)
    assert not list(tmp_path.glob("*.saving.bin*"))
    assert ckpt_tokens(tmp_path / f"{A.stem}.bin{CKPT}") == 12, "the old pair's companion"


def test_a_missing_or_changed_companion_does_not_match_its_sidecar(tmp_path, ckpt_fake):
    switch = saved_a(tmp_path, ckpt_fake)
    store, companion = switch.store, tmp_path / f"{A.stem}.bin{CKPT}"
    companion.write_bytes(b"ckpt")
    assert "companion" in quarantine.size_problem(store, A.stem, store.read_sidecar(A.stem))
    companion.unlink()
    assert "missing" in quarantine.size_problem(store, A.stem, store.read_sidecar(A.stem))


# -- deletion, quarantine, the sweep -------------------------------------------------
def test_deleting_a_session_file_deletes_its_companion(tmp_path, ckpt_fake):
    switch = saved_a(tmp_path, ckpt_fake)
    assert switch.store.delete(A.stem)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(A.stem)]


def test_quarantine_moves_the_companion_with_its_file(tmp_path, ckpt_fake):
    switch = saved_a(tmp_path, ckpt_fake)
    (tmp_path / f"{A.stem}.bin").write_bytes(b"ggsq")          # cut short
    done = sweep.sweep(SessionStore(tmp_path))
    assert any("quarantine" in line for line in done), done
    assert not list(tmp_path.glob(f"{A.stem}.bin*"))
    moved = list((tmp_path / "quarantine").glob(f"{A.stem}.*.bin{CKPT}"))
    assert len(moved) == 1 and ckpt_tokens(moved[0]) == 12
    assert moved[0].name[:-len(CKPT)] in {p.name for p in (tmp_path / "quarantine").iterdir()}


def test_sweep_deletes_leftover_and_orphaned_companions_and_keeps_good_ones(
        tmp_path, ckpt_fake):
    saved_a(tmp_path, ckpt_fake)
    (tmp_path / f"{A.stem}.saving.bin").write_bytes(b"half")
    (tmp_path / f"{A.stem}.saving.bin{CKPT}").write_bytes(b"half")
    (tmp_path / f"{B.stem}.saving.bin{CKPT}").write_bytes(b"alone")   # its file never came
    (tmp_path / f"probe.0123456789abcdef.bin{CKPT}").write_bytes(b"ckpt")
    (tmp_path / f"gone@{MODEL}.bin{CKPT}").write_bytes(b"orphan")     # its file is gone
    done = sweep.sweep(SessionStore(tmp_path))
    names = {p.name for p in tmp_path.iterdir()}
    assert f"{A.stem}.bin{CKPT}" in names, "a good file's companion stays"
    assert not {f"{A.stem}.saving.bin{CKPT}", f"{B.stem}.saving.bin{CKPT}",
                f"probe.0123456789abcdef.bin{CKPT}", f"gone@{MODEL}.bin{CKPT}"} & names, names
    assert any(f"gone@{MODEL}.bin{CKPT}" in line and "is gone" in line for line in done), done
    assert any(f"leftover temporary file {B.stem}.saving.bin{CKPT}" in line for line in done), done
    assert sweep.sweep(SessionStore(tmp_path)) == [], "nothing left to do"


def test_an_interrupted_save_is_finished_with_its_companion(tmp_path, ckpt_fake):
    """Killed after the file's rename, before its companion's: the sweep rolls forward and
    the stale companion of the old file is replaced."""
    switch = saved_a(tmp_path, ckpt_fake)
    turn(switch, A, ckpt_fake, tokens=40)
    real_move = checked_save.move_companions

    def killed(*args, **kwargs):
        raise SystemExit("killed")
    checked_save.move_companions = killed
    try:
        with pytest.raises(SystemExit):
            switch.acquire(B)
    finally:
        checked_save.move_companions = real_move
    assert ckpt_tokens(tmp_path / f"{A.stem}.bin{CKPT}") == 12, "the old companion, for now"
    done = sweep.sweep(SessionStore(tmp_path))
    assert any("finished the interrupted save" in line for line in done), done
    store = SessionStore(tmp_path)
    assert store.read_sidecar(A.stem)["n_tokens"] == 40
    assert ckpt_tokens(tmp_path / f"{A.stem}.bin{CKPT}") == 40
    assert quarantine.size_problem(store, A.stem, store.read_sidecar(A.stem)) is None
    assert not list(tmp_path.glob("*.saving.bin*"))


# -- the disk budget -------------------------------------------------------------------
def test_a_files_size_on_disk_includes_its_companion(tmp_path, ckpt_fake):
    switch = saved_a(tmp_path, ckpt_fake)
    assert switch.store.bin_bytes(A.stem) == 16
    assert switch.store.disk_bytes(A.stem) == 16 + 28
    entries, total = switch.budget.entries(keep=set())
    assert [(e.stem, e.size) for e in entries] == [(A.stem, 44)] and total == 44
    assert next(s for s in switch.store.sidecars() if s["stem"] == A.stem)["file_bytes"] == 44
    assert slot_folder_usage(tmp_path) == (44, 1)


def test_eviction_counts_companions_and_deletes_them_with_their_file(tmp_path, ckpt_fake):
    """Each save is 16 + 28 bytes: a bound of 100 holds two, so the oldest goes with its
    companion (counting the file alone, 16 bytes, all of them would fit)."""
    switch = make_switch(tmp_path, max_disk_bytes=100)
    on_disk = []
    ckpt_fake.on_save = lambda name: on_disk.append(
        sum(p.stat().st_size for p in tmp_path.iterdir() if p.is_file() and ".bin" in p.name))
    sessions = [Session(f"s{i}", "test", model=MODEL) for i in range(5)]
    for session in sessions:
        turn(switch, session, ckpt_fake)
    assert max(on_disk) + 44 <= 100, on_disk
    assert not (tmp_path / f"{sessions[0].stem}.bin").exists()
    orphans = [p.name for p in tmp_path.glob(f"*.bin{CKPT}")
               if not (tmp_path / p.name[:-len(CKPT)]).exists()]
    assert not orphans, "an evicted file's companion goes with it"


def test_an_orphaned_companion_is_loose_and_evicted_first(tmp_path, ckpt_fake):
    switch = saved_a(tmp_path, ckpt_fake, max_disk_bytes=100)
    orphan = tmp_path / f"gone@{MODEL}.bin{CKPT}"
    orphan.write_bytes(bytes(30))
    entries, total = switch.budget.entries(keep=set())
    assert total == 44 + 30 and any(e.path == orphan and e.loose for e in entries)
    turn(switch, A, ckpt_fake)          # saving B (44) makes 118 > 100: the orphan goes
    assert not orphan.exists() and (tmp_path / f"{A.stem}.bin{CKPT}").exists()


# -- renames -------------------------------------------------------------------------
def test_start_up_renames_a_files_companion_with_it(tmp_path):
    store, old = SessionStore(tmp_path), file_stem("A")
    (tmp_path / f"{old}.bin").write_bytes(b"x" * 8)
    (tmp_path / f"{old}.bin{CKPT}").write_bytes(b"ckpt")
    (tmp_path / f"{old}.json").write_text(json.dumps({
        "format": 2, "stem": old, "session_id": "A", "kind": "session", "saved_at": "t",
        "saved_bytes": 8, "made_by": {"model_path": "/models/tiny.gguf"}}))
    model_names.tag_old_files(store)
    new = stem_of("A")
    assert (tmp_path / f"{new}.bin{CKPT}").read_bytes() == b"ckpt"
    assert not (tmp_path / f"{old}.bin{CKPT}").exists()
    assert sweep.sweep(store) == [], "nothing orphaned"


def test_a_rename_interrupted_before_the_companion_moved_is_finished(tmp_path, caplog):
    """Killed after the file's rename, before its companion's: the old sidecar is still
    there, so the next start renames what is left under the old name."""
    store, old, new = SessionStore(tmp_path), file_stem("A"), stem_of("A")
    sidecar = {"format": 2, "stem": old, "session_id": "A", "kind": "session", "saved_at": "t",
               "saved_bytes": 8, "made_by": {"model_path": "/models/tiny.gguf"}}
    (tmp_path / f"{old}.json").write_text(json.dumps(sidecar))
    (tmp_path / f"{new}.json").write_text(json.dumps({**sidecar, "stem": new, "model": MODEL}))
    (tmp_path / f"{new}.bin").write_bytes(b"x" * 8)
    (tmp_path / f"{old}.bin{CKPT}").write_bytes(b"ckpt")
    with caplog.at_level(logging.INFO):
        model_names.tag_old_files(store)
        sweep.sweep(store)
    assert (tmp_path / f"{new}.bin{CKPT}").read_bytes() == b"ckpt"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        [f"{new}.bin", f"{new}.bin{CKPT}", f"{new}.json"]


def test_one_listing_of_the_folder_counts_every_file_s_companions_as_each_alone(tmp_path):
    """``companion_index`` lists the folder once for callers that size every file (the status
    page, eviction): each file's bytes are what ``companions`` finds for it alone."""
    (tmp_path / "a.bin").write_bytes(b"a" * 10)
    (tmp_path / "a.bin.ckpt").write_bytes(b"c" * 5)
    (tmp_path / "a.bin.other").write_bytes(b"o" * 3)
    (tmp_path / "b.bin").write_bytes(b"b" * 7)
    (tmp_path / "gone.bin.ckpt").write_bytes(b"g" * 2)   # a companion without its file
    (tmp_path / "c.bin.d").mkdir()                        # not a file: not counted
    (tmp_path / "a.json").write_text("{}")
    index = companion_index(tmp_path)
    assert sorted(index["a.bin"]) == ["a.bin.ckpt", "a.bin.other"]
    for name, size in (("a.bin", 18), ("b.bin", 7), ("gone.bin", 2), ("c.bin", 0)):
        assert bytes_with_companions(tmp_path / name, index) == size
        assert bytes_with_companions(tmp_path / name) == size
