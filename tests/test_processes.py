"""The llama-server command line kvproxy's tools start: slot count and pinning flags."""
import pytest

from kvproxy import processes
from kvproxy.processes import LlamaServer


@pytest.fixture(autouse=True)
def no_binary_lookup(monkeypatch):
    monkeypatch.setattr(processes, "llama_server_binary", lambda: "llama-server")


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_one_slot_by_default_with_the_similarity_pick_left_alone(tmp_path):
    cmd = LlamaServer(str(tmp_path), model="m.gguf").command()
    assert flag(cmd, "-np") == "1"
    assert "--slot-prompt-similarity" not in cmd


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_several_slots_are_explicit_and_pinned_only_by_kvproxy(tmp_path, slots):
    cmd = LlamaServer(str(tmp_path), model="m.gguf", slots=slots, ctx_size=4096).command()
    assert flag(cmd, "-np") == str(slots)
    assert flag(cmd, "--slot-prompt-similarity") == "0"
    assert flag(cmd, "-c") == "4096"  # the whole context: llama-server splits it per slot


def test_zero_slots_is_refused(tmp_path):
    with pytest.raises(ValueError):
        LlamaServer(str(tmp_path), model="m.gguf", slots=0)
