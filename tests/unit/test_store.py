"""The slot folder: which files eviction deletes first, what deleting reports, how sidecars
are written and what a failed write says."""
import errno
from datetime import datetime, timedelta, timezone

import pytest

from kvproxy.storage import store as store_module
from kvproxy.storage.budget import DiskBudget
from kvproxy.storage.sweep import is_leftover, sweep
from kvproxy.storage.store import (SIDECAR_FORMAT, STATE_FILE, STATE_LOCK, SessionStore,
                                   StorageError, migrate_sidecar, write_json_beside)


def evict(store: SessionStore, max_bytes: int, keep: set[str]) -> list[tuple[str, int]]:
    """Trim the folder to ``max_bytes`` as after a save; what was deleted, oldest first."""
    before = {p.stem: p.stat().st_size for p in store.root.glob("*.bin")}
    order = sorted(before, key=lambda stem: (store.read_sidecar(stem) or {}).get("last_used_at")
                   or (store.read_sidecar(stem) or {}).get("saved_at") or "")
    DiskBudget(store, max_bytes).trim(keep)
    return [(stem, before[stem]) for stem in order if not store.has_bin(stem)]


def add(store: SessionStore, stem: str, size: int, **times: str) -> None:
    store.bin_path(stem).write_bytes(bytes(size))
    store.update_sidecar(stem, {"session_id": stem}, **times)


def test_eviction_deletes_the_least_recently_used_first_whatever_the_names(tmp_path):
    store = SessionStore(tmp_path)
    add(store, "aa", 10, saved_at="2026-01-01", last_used_at="2026-03-01")
    add(store, "zz", 10, saved_at="2026-01-02", last_used_at="2026-01-03")
    add(store, "mm", 10, saved_at="2026-01-03", last_used_at="2026-02-01")
    assert evict(store, 20, keep=set()) == [("zz", 10)]
    assert evict(store, 10, keep=set()) == [("mm", 10)]
    assert store.has_bin("aa") and not store.has_bin("zz") and store.read_sidecar("zz") is None


def test_a_file_never_used_counts_from_when_it_was_saved(tmp_path):
    store = SessionStore(tmp_path)
    add(store, "used", 10, saved_at="2026-01-01", last_used_at="2026-01-09")
    add(store, "saved", 10, saved_at="2026-01-05")
    add(store, "unknown", 10)                 # no times at all: the oldest
    assert evict(store, 20, keep=set()) == [("unknown", 10)]
    assert evict(store, 10, keep=set()) == [("saved", 10)]


def test_a_folder_at_its_bound_is_left_alone_and_kept_files_stay(tmp_path):
    store = SessionStore(tmp_path)
    add(store, "old", 10, saved_at="2026-01-01")
    add(store, "new", 10, saved_at="2026-01-02")
    assert evict(store, 20, keep=set()) == []
    assert evict(store, 10, keep={"old"}) == [("new", 10)]
    assert store.has_bin("old")


def test_a_sidecar_without_its_file_counts_no_bytes(tmp_path):
    store = SessionStore(tmp_path)
    store.update_sidecar("lost", {"session_id": "lost"})
    assert [s["file_bytes"] for s in store.sidecars()] == [0]
    assert evict(store, 0, keep=set()) == []


def test_delete_says_whether_anything_was_there(tmp_path):
    store = SessionStore(tmp_path)
    add(store, "s", 4)
    assert store.delete("s") is True
    assert store.delete("s") is False


def test_eviction_goes_on_until_the_folder_fits(tmp_path):
    store = SessionStore(tmp_path)
    for n, stem in enumerate(("a", "b", "c")):
        add(store, stem, 10 + n, saved_at=f"2026-01-0{n + 1}")
    assert evict(store, 12, keep=set()) == [("a", 10), ("b", 11)]


def test_the_slot_folder_is_made_with_its_parents(tmp_path):
    """``var/slots`` in a fresh checkout: neither folder exists yet."""
    store = SessionStore(tmp_path / "var" / "slots")
    store.write_state({"active": "a"})
    assert store.read_state() == {"active": "a"}
    assert SessionStore(tmp_path / "var" / "slots").read_state() == {"active": "a"}


def test_a_new_sidecar_says_when_it_was_made_and_keeps_that_time(tmp_path):
    store = SessionStore(tmp_path)
    before = datetime.now(timezone.utc)
    first = store.update_sidecar("s", {"session_id": "s"})
    made = datetime.fromisoformat(first["created_at"])
    assert before - timedelta(seconds=1) <= made <= datetime.now(timezone.utc)
    assert first["hits"] == 0, "a file made by a save (a base snapshot) has served no request"
    later = store.update_sidecar("s", {"session_id": "other"}, count="hits", saved_at="t")
    assert (later["created_at"], later["hits"], later["session_id"]) == (first["created_at"], 1, "s")
    assert store.read_sidecar("s") == later


def test_an_older_sidecar_gets_a_checked_size_only_for_a_file_that_was_saved():
    saved = migrate_sidecar({"format": 1, "stem": "x", "saved_at": "t", "n_bytes": 7})
    never_saved = migrate_sidecar({"format": 1, "stem": "y", "n_bytes": 7})
    assert saved["saved_bytes"] == 7 and saved["format"] == SIDECAR_FORMAT
    assert "saved_bytes" not in never_saved and never_saved["format"] == SIDECAR_FORMAT


def test_a_format_2_sidecar_names_the_model_its_made_by_gives():
    made = migrate_sidecar({"format": 2, "stem": "x", "saved_at": "t",
                            "made_by": {"model_path": "/m/SmolLM2-135M.gguf"}})
    assert made["model"] == "SmolLM2-135M" and made["format"] == 3
    assert migrate_sidecar({"format": 2, "stem": "y", "hits": 1})["model"] is None


def test_a_sidecar_write_cut_off_before_its_rename_leaves_what_the_sweep_deletes(tmp_path):
    """The temporary file sits beside the sidecar (a rename within one folder is atomic), is
    never read as a sidecar, and the start-up sweep knows it for a leftover."""
    store = SessionStore(tmp_path)
    store.update_sidecar("s", {"session_id": "s"})
    tmp = write_json_beside(store.sidecar_path("s"), {"format": 2, "stem": "s", "cut": True})
    assert tmp.parent == tmp_path and is_leftover(tmp.name)
    assert [s.get("cut") for s in store.sidecars()] == [None]
    assert sweep(store) == [f"deleted leftover temporary file {tmp.name}"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == ["s.json"]


def failing_file(error):
    """``os.fdopen`` for a disk where every write fails with ``error``."""
    class Failing:
        def __init__(self, fd, *args, **kwargs):
            store_module.os.close(fd)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise error
    return Failing


@pytest.mark.parametrize("step", ["write", "rename"])
@pytest.mark.parametrize("error,reason", [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (OSError("the folder went away"), "the folder went away"),   # no errno: the text itself
])
def test_a_failed_write_keeps_the_old_file_and_says_which_file_and_why(tmp_path, monkeypatch,
                                                                       step, error, reason):
    store = SessionStore(tmp_path)
    store.write_state({"active": "a"})

    def fail(*args, **kwargs):
        raise error
    if step == "rename":
        monkeypatch.setattr(store_module.os, "replace", fail)
    else:
        monkeypatch.setattr(store_module.os, "fdopen", failing_file(error))
    with pytest.raises(StorageError) as raised:
        store.write_state({"active": "b"})
    assert str(raised.value) == f"cannot write {STATE_FILE} in the slot folder: {reason}"
    monkeypatch.undo()
    assert store.read_state() == {"active": "a"}
    # The state table's lock file stays by design; nothing else may be left beside the state.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([STATE_FILE, STATE_LOCK]), \
        "the temporary file is removed"


@pytest.mark.parametrize("text", ['[1, 2]', '"text"', '{"format": 2}', '{"format": "2", "stem": "x"}',
                                  '{half'])
def test_json_that_is_not_a_sidecar_or_state_is_read_as_nothing(tmp_path, text):
    """A foreign or damaged file in the slot folder: no crash, no session made of it."""
    store = SessionStore(tmp_path)
    store.sidecar_path("x").write_text(text)
    assert store.read_sidecar("x") is None and store.sidecars() == []
    if not text.startswith("{\""):
        (tmp_path / STATE_FILE).write_text(text)
        assert store.read_state() == {}
