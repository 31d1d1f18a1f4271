"""A save stored as chunks: its sidecar names the file that is there at every moment a reader
can look under the stem's lock (issue 37). ``stored_as: file`` while the whole file is there
(the newest save, by the crash rule of ``chunks.files``), ``chunks`` once only the manifest is;
the status page, the admin API and ``store.saved_name`` read it."""
from __future__ import annotations

import contextlib

import pytest

from kvproxy.errors import StorageError
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.store import SessionStore
from tests.slot_files import slot_file

PROMPT = list(range(100, 180))   # 80 tokens: 5 chunks of 16
C = 16
MADE_BY = {"model_path": "/m.gguf", "n_ctx": 4096, "build_info": "b1"}


def save(files: ChunkedFiles, stem: str, tokens: list[int]) -> dict | None:
    """A checked save of a slot file holding ``tokens``, as ``saving.SlotSaver`` makes it."""
    data = slot_file(tokens)

    def write(name: str) -> dict:
        (files.store.root / name).write_bytes(data)
        return {"n_saved": len(tokens), "n_written": len(data)}

    def describe(answer: dict, size: int) -> dict:
        return {"format": 3, "stem": stem, "saved_at": f"2026-12-06T00:00:{len(tokens)}+00:00",
                "saved_bytes": size, "n_bytes": answer["n_written"], "made_by": MADE_BY,
                "session_id": "s", "kind": "session", "stored_as": "file", "chunks": None,
                "written_bytes": size}
    return files.save(stem, write, describe)


def disagreement(store: SessionStore, stem: str) -> str | None:
    """What a reader of the sidecar would get wrong about the files now, or None."""
    sidecar = store.read_sidecar(stem) or {}
    named = store.root / store.saved_name(stem, sidecar)
    whole = store.bin_path(stem).is_file()
    if not named.is_file():
        return f"the sidecar says {sidecar.get('stored_as')}, but {named.name} is gone"
    if (sidecar.get("stored_as") == "file") != whole:
        return f"the sidecar says {sidecar.get('stored_as')}, the whole file is " \
               f"{'there' if whole else 'gone'}"
    return None


@pytest.fixture
def files(tmp_path) -> ChunkedFiles:
    return ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)


@pytest.fixture
def readers(files, monkeypatch) -> list[str | None]:
    """What a reader sees each time the stem's lock is let go (``disagreement``): the moments
    one under the lock can look."""
    store, seen, held = files.store, [], []
    real = store.stem_lock

    @contextlib.contextmanager
    def watched(stem: str):
        with real(stem):
            held.append(stem)
            try:
                yield
            finally:
                held.pop()
                if not held:   # the next holder reads what is here now
                    seen.append(disagreement(store, stem))
    monkeypatch.setattr(store, "stem_lock", watched)
    return seen


def test_a_reader_never_sees_the_sidecar_name_a_whole_file_the_cut_deleted(files, readers):
    save(files, "a", PROMPT)
    save(files, "a", PROMPT + [5, 6, 7])   # a turn more, over the session stored as chunks
    assert readers and readers == [None] * len(readers)
    assert files.store.read_sidecar("a")["stored_as"] == "chunks"
    assert not files.store.bin_path("a").exists()


def test_a_sidecar_that_cannot_be_written_keeps_the_save_whole(files, monkeypatch):
    """The cut names its manifest before it deletes the whole file: when the sidecar cannot
    say so, the whole file stays, and the sidecar still names it."""
    def full_disk(*args, **kwargs):
        raise StorageError("no space left on device")
    monkeypatch.setattr(files.store, "update_sidecar", full_disk)
    assert save(files, "a", PROMPT) is not None
    monkeypatch.undo()
    assert files.store.bin_path("a").is_file()
    assert disagreement(files.store, "a") is None
    assert files.check("a")[1] is None


def test_a_crash_after_the_sidecar_names_the_chunks_leaves_the_whole_file_named(files,
                                                                              monkeypatch):
    """Killed between the sidecar's update and the whole file's deletion: the whole file is the
    newest save (the crash rule), the sweep deletes the manifest beside it and the sidecar
    names the whole file again."""
    class Killed(BaseException):
        pass

    def die(*args, **kwargs):
        raise Killed()
    monkeypatch.setattr("kvproxy.storage.chunks.files.unlink_with_companions", die)
    with pytest.raises(Killed):
        save(files, "a", PROMPT)
    monkeypatch.undo()
    files.sweep()
    sidecar = files.store.read_sidecar("a")
    assert disagreement(files.store, "a") is None
    assert sidecar["chunks"] is None and sidecar["written_bytes"] == sidecar["saved_bytes"]
    assert files.check("a")[1] is None
