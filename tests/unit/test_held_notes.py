"""What answers teach a sidecar is held and written at most once a second per session
(storage/notes.py): readers in the process see it at once, the file within a second, and no
count is lost or counted twice."""
from __future__ import annotations

import threading
import time

import pytest

from kvproxy.storage import store as store_module
from kvproxy.storage.notes import HeldNotes
from kvproxy.storage.store import SessionStore, StorageError, read_json, write_json_atomic
from tests.support import Clock

DEFAULTS = {"session_id": "s", "kind": "session"}


@pytest.fixture
def clock():
    return Clock(100.0)


@pytest.fixture
def store(tmp_path, clock):
    store = SessionStore(tmp_path)
    # A writer thread that never comes due: these tests write by the clock alone.
    store.notes = HeldNotes(store.write_held, every=1.0, clock=clock)
    store.notes._start_writer = lambda: None
    return store


def on_disk(store: SessionStore, stem: str) -> dict:
    return read_json(store.sidecar_path(stem)) or {}


def hit(store: SessionStore, stem: str = "s", n: int = 1, **fields) -> None:
    for _ in range(n):
        store.note_use(stem, DEFAULTS, count=("hits",), **fields)


def test_the_first_note_is_written_at_once_and_the_next_within_the_second_held(store, clock):
    hit(store, last_cache="hit")
    assert on_disk(store, "s")["hits"] == 1
    clock.now += 0.5
    hit(store, n=2, last_cache="restored")
    assert on_disk(store, "s")["hits"] == 1                  # held ...
    assert store.read_sidecar("s")["hits"] == 3              # ... and seen by this process
    assert store.read_sidecar("s")["last_cache"] == "restored"
    assert [s["hits"] for s in store.sidecars()] == [3]


def test_a_note_after_the_second_writes_everything_held(store, clock):
    hit(store)
    clock.now += 0.5
    hit(store, last_cache="a")
    clock.now += 0.6   # 1.1 s after the write
    hit(store, last_cache="b")
    assert on_disk(store, "s")["hits"] == 3
    assert on_disk(store, "s")["last_cache"] == "b"
    assert store.notes.peek("s") is None


def test_another_write_of_the_sidecar_takes_the_held_notes_along(store, clock):
    hit(store)
    hit(store, n=2)
    store.update_sidecar("s", {}, count="restores", refused=None)
    assert on_disk(store, "s")["hits"] == 3
    assert on_disk(store, "s")["restores"] == 1
    assert store.notes.peek("s") is None


def test_a_save_writes_its_sidecar_without_the_held_notes_which_count_once(store, clock):
    """A save builds its sidecar from the file (merged_sidecar) and writes it itself; the
    held notes are added afterwards, so the hits are neither lost nor counted twice."""
    hit(store)
    hit(store, n=4)
    saved = store.merged_sidecar("s", {}, saved_at="t1", n_tokens=10)
    assert saved["hits"] == 1
    write_json_atomic(store.sidecar_path("s"), saved)
    store.notes.flush()
    assert on_disk(store, "s")["hits"] == 5
    assert on_disk(store, "s")["saved_at"] == "t1"


def test_a_failed_write_holds_the_notes_again(store, clock, monkeypatch):
    hit(store)
    hit(store, n=2)
    clock.now += 2

    def refuse(path, data):
        raise StorageError("disk full")
    monkeypatch.setattr(store_module, "_write_or_storage_error", refuse)
    with pytest.raises(StorageError):
        hit(store)
    assert store.read_sidecar("s")["hits"] == 4
    monkeypatch.undo()
    clock.now += 2
    hit(store)
    assert on_disk(store, "s")["hits"] == 5


def test_a_refused_save_change_keeps_the_notes_held(store, clock):
    store.update_sidecar("s", DEFAULTS, saved_at="new")
    clock.now += 2
    hit(store)
    hit(store, n=2)
    assert store.update_sidecar("s", {}, of_save="old", refused="x") is None
    assert store.read_sidecar("s")["hits"] == 3
    store.notes.flush()
    assert on_disk(store, "s")["hits"] == 3


def test_deleting_a_session_forgets_its_held_notes(store, clock):
    hit(store)
    hit(store, n=2)
    store.delete("s")
    store.notes.flush()
    assert not store.sidecar_path("s").exists()
    assert store.read_sidecar("s") is None


def test_every_model_of_the_folder_shares_the_held_notes(store, clock):
    other = store.for_model("m2")
    assert other.notes is store.notes
    hit(other, "s@m2")
    hit(other, "s@m2", n=2)
    assert store.read_sidecar("s@m2")["hits"] == 3


def test_the_writer_thread_writes_held_notes_a_second_after_the_last_write(tmp_path):
    store = SessionStore(tmp_path)
    store.notes = HeldNotes(store.write_held, every=0.05)
    hit(store)
    hit(store, n=2)
    assert on_disk(store, "s")["hits"] == 1
    deadline = time.monotonic() + 10
    while on_disk(store, "s").get("hits") != 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert on_disk(store, "s")["hits"] == 3
    assert store.notes.peek("s") is None
    assert any(t.name == "kvproxy-sidecar-notes" and t.daemon for t in threading.enumerate())


def test_notes_from_many_threads_are_all_counted(tmp_path):
    store = SessionStore(tmp_path)
    store.notes = HeldNotes(store.write_held, every=0.01)
    threads = [threading.Thread(target=hit, args=(store, f"s{n % 3}", 50)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    store.notes.flush()
    assert sorted(on_disk(store, f"s{n}")["hits"] for n in range(3)) == [100, 100, 100]


def test_a_note_exactly_a_second_after_the_write_is_due(store, clock):
    hit(store)
    clock.now += 1.0
    hit(store)
    assert on_disk(store, "s")["hits"] == 2


def test_the_writer_knows_which_stems_are_due_and_how_long_to_wait(store, clock):
    notes = store.notes
    hit(store, "a")                    # written at 100.0
    clock.now += 0.25
    hit(store, "b")                    # written at 100.25
    clock.now += 0.25
    hit(store, "a")
    hit(store, "b")                    # both held
    assert notes._due() == ([], pytest.approx(0.5))
    clock.now += 0.5
    assert notes._due() == (["a"], pytest.approx(0.25))
    store.write_held("a")
    clock.now += 2
    assert notes._due() == (["b"], None)
    store.write_held("b")
    clock.now += 2
    assert notes._due() == ([], None)
    assert notes._written == {}        # old write times are forgotten once nothing is held
    hit(store, "a")
    assert on_disk(store, "a")["hits"] == 3


def test_notes_held_while_a_failed_write_was_made_add_to_the_ones_put_back(store, clock):
    hit(store)
    hit(store, n=2, last_cache="old")
    taken = store.notes.take("s")          # a write begins ...
    hit(store, n=3, last_cache="new")      # ... notes come meanwhile ...
    store.notes.put_back("s", taken)       # ... and it fails
    seen = store.read_sidecar("s")
    assert (seen["hits"], seen["last_cache"]) == (6, "new")
    seen["hits"] = 99                      # what a reader does with its copy stays its own
    store.notes.peek("s").counts["hits"] = 99
    assert store.read_sidecar("s")["hits"] == 6


def test_a_deleted_session_starts_afresh_its_next_note_written_at_once(store, clock):
    hit(store)
    store.delete("s")
    hit(store)
    assert on_disk(store, "s")["hits"] == 1


def test_a_recent_write_keeps_holding_back_the_next_note(store, clock):
    hit(store)
    clock.now += 0.5
    store.notes._due()                 # the writer looking meanwhile forgets nothing recent
    hit(store)
    assert on_disk(store, "s")["hits"] == 1
    store.delete("never-noted")        # nothing held for it: nothing to forget


def test_a_first_note_whose_write_failed_is_seen_from_its_defaults(store, clock, monkeypatch):
    def refuse(path, data):
        raise StorageError("disk full")
    monkeypatch.setattr(store_module, "_write_or_storage_error", refuse)
    with pytest.raises(StorageError):
        hit(store)
    seen = store.read_sidecar("s")
    assert (seen["session_id"], seen["kind"], seen["hits"]) == ("s", "session", 1)
    taken = store.notes.take("s")
    store.note_use("s", DEFAULTS, count=("hits", "restores"))   # a counter the first lacks
    store.notes.put_back("s", taken)
    assert (store.read_sidecar("s")["hits"], store.read_sidecar("s")["restores"]) == (2, 1)


def test_a_sidecar_that_cannot_be_written_is_tried_again_a_second_later_not_in_a_loop(
        tmp_path, monkeypatch):
    store = SessionStore(tmp_path)
    store.notes = HeldNotes(store.write_held, every=0.1)
    hit(store)
    tries = []

    def locked(stem):
        tries.append(stem)
        raise StorageError("cannot lock a slot file: read-only file system")
    monkeypatch.setattr(store, "stem_lock", locked)
    hit(store)                       # held: the writer thread tries it
    time.sleep(0.55)
    assert 2 <= len(tries) <= 8      # about every 0.1 s, not thousands of times
    assert store.read_sidecar("s") is not None
    assert store.notes.peek("s").counts == {"hits": 1}
