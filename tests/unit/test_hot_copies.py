"""Hot copies: whole files of recent saves and restores kept in a folder in memory, so a restore
of a conversation stored as chunks reads a whole file instead of waiting for one put together."""
import os

import pytest

from kvproxy.storage import sweep
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.chunks.hot import HotCopies
from kvproxy.storage.store import SessionStore
from kvproxy.telemetry import metrics
from kvproxy.upstream.slot_layout import layout_of
from tests.slot_files import restored, save, slot_file

PROMPT = list(range(100, 180))          # 80 tokens: 5 chunks of 16
C = 16


def hot_files(tmp_path, budget: int = 10**9) -> ChunkedFiles:
    return ChunkedFiles(SessionStore(tmp_path / "slots"), chunk_tokens=C,
                        hot=HotCopies(tmp_path / "hot", budget))


def copies(files: ChunkedFiles) -> list[str]:
    return sorted(path.name for path in files.hot.root.iterdir())


def restores(source: str) -> float:
    return metrics.HOT_RESTORES.labels(source)._value.get()


def reader_of(files: ChunkedFiles, stem: str):
    """What llama-server reads restoring ``stem``: the name it is given, and where it leads."""
    with files.staged(stem) as name:
        path = files.store.root / name
        return name, os.path.realpath(path), path.read_bytes()


def test_a_save_lands_in_memory_and_no_whole_file_stays_in_the_slot_folder(tmp_path):
    files = hot_files(tmp_path)
    data = slot_file(PROMPT + [5, 6, 7])
    save(files, "a", data)
    assert [p.name for p in files.store.root.glob("*.bin")] == []
    assert files.store.chunked_path("a").is_file()
    [copy] = copies(files)
    assert copy.startswith("a.") and (files.hot.root / copy).read_bytes() == data


def test_a_restore_reads_the_hot_copy_and_leaves_nothing_behind(tmp_path):
    files = hot_files(tmp_path)
    data = slot_file(PROMPT + [5, 6, 7])
    save(files, "a", data)
    hot_before = restores("hot")
    name, target, read = reader_of(files, "a")
    assert read == data and target == str(files.hot.root / copies(files)[0])
    assert name.endswith(".restoring.bin") and not (files.store.root / name).exists()
    assert restores("hot") == hot_before + 1


def test_a_copy_that_is_not_the_manifests_file_is_never_restored(tmp_path):
    files = hot_files(tmp_path)
    save(files, "a", slot_file(PROMPT + [1] * 8))
    [older] = copies(files)
    stale = (files.hot.root / older).read_bytes()
    save(files, "a", slot_file(PROMPT + [1] * 8 + [2] * 4))
    [newer] = copies(files)
    assert newer != older, "the older save's copy goes"
    # The newer copy damaged in memory (or another kvproxy's file by that name): assembled.
    (files.hot.root / newer).write_bytes(stale)
    assembled_before = restores("assembled")
    _, target, read = reader_of(files, "a")
    assert read == slot_file(PROMPT + [1] * 8 + [2] * 4)
    assert restores("assembled") == assembled_before + 1
    assert not target.startswith(str(files.hot.root / newer))


def test_a_restore_put_together_from_chunks_stays_as_the_hot_copy(tmp_path):
    files = hot_files(tmp_path)
    data = slot_file(PROMPT + [9] * 3)
    save(files, "a", data)
    files.hot.forget("a")                       # as on a fresh node, or after a reboot
    assert copies(files) == []
    assert reader_of(files, "a")[2] == data     # put together from the chunks
    [copy] = copies(files)
    assert (files.hot.root / copy).read_bytes() == data
    hot_before = restores("hot")
    assert reader_of(files, "a")[2] == data and restores("hot") == hot_before + 1


def test_the_least_recently_used_copies_go_past_the_budget(tmp_path):
    size = len(slot_file(PROMPT))
    files = hot_files(tmp_path, budget=2 * size)
    save(files, "a", slot_file(PROMPT))
    save(files, "b", slot_file(PROMPT[:-1] + [1]))
    os.utime(files.hot.root / copies(files)[1], (1, 1))   # b: used long ago
    save(files, "c", slot_file(PROMPT[:-1] + [2]))
    assert sorted(name.split(".")[0] for name in copies(files)) == ["a", "c"]
    assert files.hot.held_bytes() <= 2 * size


def test_a_copy_lent_to_a_restore_is_not_deleted_until_the_restore_ends(tmp_path):
    files = hot_files(tmp_path, budget=len(slot_file(PROMPT)))
    save(files, "a", slot_file(PROMPT))
    with files.hot.lent("a", layout_of(slot_file(PROMPT))) as lent:
        assert lent is not None
        save(files, "b", slot_file(PROMPT[:-1] + [1]))
        assert lent.exists(), "a copy llama-server may be reading is not deleted"
    save(files, "c", slot_file(PROMPT[:-1] + [2]))
    assert [name.split(".")[0] for name in copies(files)] == ["c"]


def test_a_file_larger_than_the_budget_is_not_kept(tmp_path):
    files = hot_files(tmp_path, budget=100)
    save(files, "a", slot_file(PROMPT))
    assert copies(files) == [] and files.store.chunked_path("a").is_file()
    assert restored(files, "a") == slot_file(PROMPT)


def test_a_file_kept_whole_is_a_file_of_the_slot_folder_not_a_link_to_memory(tmp_path):
    files = hot_files(tmp_path)
    data = slot_file(PROMPT[:C - 1])            # shorter than one chunk: stays whole
    save(files, "short", data)
    path = files.store.bin_path("short")
    assert not path.is_symlink() and path.read_bytes() == data
    assert copies(files) == []


def test_a_failed_save_leaves_nothing_in_memory(tmp_path):
    files = hot_files(tmp_path)

    def failing(name):
        (files.store.root / name).write_bytes(b"half")
        raise OSError("disk full")
    with pytest.raises(Exception):
        files.save("a", failing, lambda answer, size: {})
    assert copies(files) == [] and not list(files.store.root.glob("*.bin"))


def test_deleting_or_setting_aside_a_session_drops_its_copy(tmp_path):
    files = hot_files(tmp_path)
    save(files, "a", slot_file(PROMPT))
    save(files, "b", slot_file(PROMPT[:-1] + [1]))
    files.delete("a")
    files.set_aside("b", "a test")
    assert copies(files) == []


@pytest.mark.parametrize("reboot", [False, True])
def test_a_crash_between_the_save_and_the_cut_keeps_the_newest_save(tmp_path, reboot):
    """kill -9 after llama-server saved into memory and the file was put in place, before the
    cut: the start-up sweep makes the link a whole file (the newest save); after a reboot the
    memory is gone and the link with it."""
    files = hot_files(tmp_path)
    save(files, "a", slot_file(PROMPT))
    newer = slot_file(PROMPT + [4] * 20)
    in_memory = files.hot.incoming("a")
    in_memory.write_bytes(newer)
    files.store.bin_path("a").symlink_to(in_memory)
    files.store.update_sidecar("a", {}, saved_bytes=len(newer), stored_as="file")
    (files.store.root / "b.saving.bin").symlink_to(files.hot.incoming("b"))  # never written
    if reboot:
        in_memory.unlink()
    lines = files.sweep()
    assert not [p for p in files.store.root.iterdir() if p.is_symlink()]
    assert not [p for p in files.hot.root.iterdir() if ".incoming" in p.name]
    if reboot:
        assert any("is gone" in line for line in lines)
        assert not files.store.bin_path("a").exists()
    else:
        assert files.store.bin_path("a").read_bytes() == newer
        assert restored(files, "a") == newer
        assert files.check("a")[1] is None


def test_the_folder_sweep_alone_makes_a_link_a_whole_file(tmp_path):
    store = SessionStore(tmp_path / "slots")
    elsewhere = tmp_path / "memory.bin"
    elsewhere.write_bytes(b"slot")
    store.bin_path("a").symlink_to(elsewhere)
    sweep.sweep(store)
    assert not store.bin_path("a").is_symlink()


def test_a_file_kept_whole_that_cannot_be_copied_stays_a_link_to_its_file(tmp_path, monkeypatch):
    files = hot_files(tmp_path)
    data = slot_file(PROMPT[:C - 1])

    def no_room(link):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("kvproxy.storage.chunks.files.materialize", no_room)
    assert save(files, "short", data) is not None
    assert files.store.bin_path("short").is_symlink()
    assert files.store.bin_path("short").read_bytes() == data, "its file in memory is kept"
    monkeypatch.undo()
    files.sweep()
    assert not files.store.bin_path("short").is_symlink()
    assert files.store.bin_path("short").read_bytes() == data
