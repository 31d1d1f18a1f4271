"""The slot folder: which files eviction deletes first, and what deleting reports."""
from kvproxy.store import SessionStore


def add(store: SessionStore, stem: str, size: int, **times: str) -> None:
    store.bin_path(stem).write_bytes(bytes(size))
    store.update_sidecar(stem, {"session_id": stem}, **times)


def test_eviction_deletes_the_least_recently_used_first_whatever_the_names(tmp_path):
    store = SessionStore(tmp_path)
    add(store, "aa", 10, saved_at="2026-01-01", last_used_at="2026-03-01")
    add(store, "zz", 10, saved_at="2026-01-02", last_used_at="2026-01-03")
    add(store, "mm", 10, saved_at="2026-01-03", last_used_at="2026-02-01")
    assert store.evict(20, keep=set()) == [("zz", 10)]
    assert store.evict(10, keep=set()) == [("mm", 10)]
    assert store.has_bin("aa") and not store.has_bin("zz") and store.read_sidecar("zz") is None


def test_a_file_never_used_counts_from_when_it_was_saved(tmp_path):
    store = SessionStore(tmp_path)
    add(store, "used", 10, saved_at="2026-01-01", last_used_at="2026-01-09")
    add(store, "saved", 10, saved_at="2026-01-05")
    add(store, "unknown", 10)                 # no times at all: the oldest
    assert store.evict(20, keep=set()) == [("unknown", 10)]
    assert store.evict(10, keep=set()) == [("saved", 10)]


def test_a_folder_at_its_bound_is_left_alone_and_kept_files_stay(tmp_path):
    store = SessionStore(tmp_path)
    add(store, "old", 10, saved_at="2026-01-01")
    add(store, "new", 10, saved_at="2026-01-02")
    assert store.evict(20, keep=set()) == []
    assert store.evict(10, keep={"old"}) == [("new", 10)]
    assert store.has_bin("old")


def test_a_sidecar_without_its_file_counts_no_bytes(tmp_path):
    store = SessionStore(tmp_path)
    store.update_sidecar("lost", {"session_id": "lost"})
    assert [s["file_bytes"] for s in store.sidecars()] == [0]
    assert store.evict(0, keep=set()) == []


def test_delete_says_whether_anything_was_there(tmp_path):
    store = SessionStore(tmp_path)
    add(store, "s", 4)
    assert store.delete("s") is True
    assert store.delete("s") is False


def test_eviction_goes_on_until_the_folder_fits(tmp_path):
    store = SessionStore(tmp_path)
    for n, stem in enumerate(("a", "b", "c")):
        add(store, stem, 10 + n, saved_at=f"2026-01-0{n + 1}")
    assert store.evict(12, keep=set()) == [("a", 10), ("b", 11)]
