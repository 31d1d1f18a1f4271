"""The llama-server command line kvproxy's tools start: slot count and pinning flags."""
import pytest

from kvproxy.launch import processes
from kvproxy.launch.processes import LlamaServer


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


# -- make run: LLAMA_SLOTS, LLAMA_CTX, LLAMA_CACHE_RAM ------------------------------
from kvproxy.launch.serve import llama_layout  # noqa: E402


def test_make_run_keeps_one_slot_and_its_ram_cache_by_default():
    assert llama_layout({}) == (1, 8192, 16384)


def test_make_run_with_several_slots_turns_the_ram_cache_off():
    assert llama_layout({"LLAMA_SLOTS": "2"}) == (2, 8192, 0)
    assert llama_layout({"KVPROXY_API_KEYS": "k=u"}) == (1, 8192, 0)  # shared by every user
    assert llama_layout({"KVPROXY_API_KEYS_FILE": "/k", "LLAMA_CACHE_RAM": "64"})[2] == 64
    assert llama_layout({"LLAMA_SLOTS": "4", "LLAMA_CTX": "16384", "LLAMA_CACHE_RAM": "512"}) == \
        (4, 16384, 512)


@pytest.mark.parametrize("env", [{"LLAMA_SLOTS": "0"}, {"LLAMA_SLOTS": "two"},
                                 {"LLAMA_CTX": "10"}, {"LLAMA_CACHE_RAM": "-1"}])
def test_make_run_names_a_bad_layout_variable(env):
    with pytest.raises(ValueError, match=f"^{next(iter(env))}="):
        llama_layout(env)


def test_make_run_refuses_a_bad_slot_count_before_starting_anything(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "kvproxy.launch.serve"], cwd=root, capture_output=True,
                            text=True, timeout=60,
                            env={**os.environ, "KVPROXY_SLOT_DIR": str(tmp_path / "slots"),
                                 "KVPROXY_LOG_DIR": str(tmp_path / "log"), "LLAMA_SLOTS": "0"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("kvproxy: LLAMA_SLOTS='0' is invalid") and \
        result.stderr.count("\n") == 1


# -- stopping waits for every process of the group ----------------------------------
GROUP_SCRIPT = r"""
import os, signal, subprocess, sys, time
from kvproxy.launch.processes import become_subreaper, group_alive, stop_process
become_subreaper()
marker = sys.argv[1]
# The leader starts a member of its group that, once the leader is gone, takes a while to
# "save" and exit, as a gunicorn worker whose master was killed does.
member = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: None)  # SIGTERM is a graceful stop\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent: time.sleep(0.05)\n"
    "time.sleep(1.5)\n"
    "open(sys.argv[1], 'w').write('saved')\n")
leader = subprocess.Popen([sys.executable, "-c",
                           "import subprocess, sys, time\n"
                           "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
                           "time.sleep(60)\n", member, marker], start_new_session=True)
time.sleep(1.0)
os.kill(leader.pid, signal.SIGKILL)
leader.wait(5)
started = time.monotonic()
stop_process(leader, 20)
print(os.path.exists(marker), round(time.monotonic() - started, 1), group_alive(leader.pid))
"""


def test_stopping_waits_until_every_process_of_the_group_has_ended(tmp_path):
    """make run stops llama-server only after this returns for kvproxy: a worker whose
    master was killed must have finished its exit save by then."""
    import subprocess
    import sys
    from pathlib import Path
    marker = tmp_path / "saved"
    result = subprocess.run([sys.executable, "-c", GROUP_SCRIPT, str(marker)], timeout=60,
                            cwd=Path(__file__).resolve().parents[2], capture_output=True,
                            text=True)
    saved, waited, alive = result.stdout.split()
    assert saved == "True", f"stop_process returned before the member's save ({result.stderr})"
    assert alive == "False" and float(waited) < 10
