"""The store interface the switch uses (``SessionFiles``) and the slot folder behind it."""
import inspect
from pathlib import Path

import pytest

from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.folder import FolderFiles
from kvproxy.storage.session_files import NotAsRecorded, SaveFailed, SessionFiles
from kvproxy.storage.store import SessionStore

STORAGE = Path(__file__).resolve().parents[2] / "kvproxy" / "storage"


def interface_methods():
    return [name for name, member in vars(SessionFiles).items()
            if callable(member) and not name.startswith("_")]


@pytest.mark.parametrize("store", [FolderFiles, ChunkedFiles])
@pytest.mark.parametrize("name", interface_methods())
def test_both_stores_implement_every_method_of_the_interface(store, name):
    wanted = inspect.signature(getattr(SessionFiles, name))
    found = inspect.signature(getattr(store, name))
    assert list(found.parameters) == list(wanted.parameters), name


def test_storage_never_talks_to_llama_server():
    """Files only: the save's call to llama-server is the caller's (``write``); storage reads
    llama-server's file format (``upstream.slot_file``, ``slot_layout``), never its API."""
    for module in STORAGE.rglob("*.py"):
        text = module.read_text()
        for client in ("upstream.llama", "upstream.view", "import requests"):
            assert client not in text, (module.name, client)


def test_a_save_writes_through_the_callers_call_and_is_checked(tmp_path):
    files = FolderFiles(SessionStore(tmp_path))
    names = []

    def write(name):
        names.append(name)
        (tmp_path / name).write_bytes(b"x" * 8)
        return {"n_saved": 3, "n_written": 8}

    sidecar = files.save("s", write, lambda answer, size: {"stem": "s", "format": 3,
                                                           "saved_at": "t", "saved_bytes": size})
    assert names == [files.scratch_path("s").name] and sidecar["saved_bytes"] == 8
    assert files.has("s") and files.tokens("s") is None, "not a slot file: no tokens"
    with files.staged("s") as name:
        assert name == "s.bin"
    assert files.check("s") == (files.store.read_sidecar("s"), None)
    with pytest.raises(NotAsRecorded):
        files.save("s", write, lambda answer, size: {}, lambda n_saved: False)
    with pytest.raises(SaveFailed):
        files.save("s", lambda name: {"n_saved": 3, "n_written": 9}, lambda answer, size: {})
    assert (tmp_path / "s.bin").read_bytes() == b"x" * 8, "the old file is kept"
    assert files.delete("s") and not files.has("s") and files.sidecars() == []
