"""The disk side and the start-up checks against the real llama-server."""
import json
import os
import subprocess
import sys
import time

import anthropic
import openai
import pytest
import requests

from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.upstream.llama import LlamaClient
from kvproxy.launch.processes import REPO_ROOT, LlamaServer, ProxyServer, free_port, stop_process
from kvproxy.ops.startup import contract_problem
from kvproxy.storage.store import SessionStore
from kvproxy.slots.switch import SlotSwitch
from tests.conftest import long_text

pytestmark = pytest.mark.real

SYSTEM = "You are a terse assistant. Answer in one short sentence."


def ask(client, session, question="Name a colour."):
    raw = client.chat.completions.with_raw_response.create(
        model="any", max_tokens=4, temperature=0, extra_headers={"X-Session-Id": session},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return raw.headers


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def files(stack):
    listing = requests.get(stack.url + "/api/sessions", timeout=10).json()
    return {s["session_id"]: stack.slot_dir / s["file"] for s in listing if s.get("kind") == "session"}


def test_every_real_save_matches_its_sidecar(stack, client):
    for session in ("disk-a", "disk-b", "disk-a", "disk-b"):
        ask(client, session)
    long_question = "Summarise: " + long_text(300, seed=4101)   # more than one chunk
    ask(client, "disk-long", long_question)
    ask(client, "disk-a")
    store = SessionStore(stack.slot_dir)
    saved = [s for s in store.sidecars() if s.get("saved_at")]
    assert {s["session_id"] for s in saved} >= {"disk-a", "disk-b"}
    chunked = ChunkedFiles(store)
    for sidecar in saved:   # llama-server's n_written is what the store gives back
        assert sidecar["saved_bytes"] == store.bin_bytes(sidecar["stem"]) == sidecar["n_bytes"] > 0
        assert chunked.check(sidecar["stem"]) == (store.read_sidecar(sidecar["stem"]), None)
        # at least one whole chunk (KVPROXY_CHUNK_TOKENS, 256): stored as chunks, and its own
        # file is far smaller than the whole; a shorter one is kept whole
        assert sidecar["stored_as"] == ("chunks" if sidecar["n_tokens"] >= 256 else "file")
        if sidecar["stored_as"] == "chunks":   # 23,040 bytes per token of the bundled model
            assert 0 < sidecar["file_bytes"] < sidecar["n_bytes"] - sidecar["chunks"] * 256 * 23_000
    assert "chunks" in {s["stored_as"] for s in saved}
    assert not list(stack.slot_dir.glob("*.saving.bin")) and not list(stack.slot_dir.glob("probe.*"))


def test_a_failed_real_save_is_dropped_keeps_the_old_file_and_answers(stack, client):
    """A directory where llama-server must write makes its save fail (HTTP 500): the save of
    the session leaving the slot is dropped, its old file kept, and the swap goes ahead."""
    ask(client, "disk-a")
    ask(client, "disk-b")
    ask(client, "disk-a")                        # the slot holds disk-a; its file is on disk
    path = files(stack)["disk-a"]
    before = path.read_bytes()
    saved_at = json.loads(path.with_suffix(".json").read_text())["saved_at"]
    blocker = path.with_name(path.with_suffix("").name + ".saving.bin")
    blocker.mkdir()
    try:
        assert ask(client, "disk-b")["x-kvproxy-cache"] == "restored"
        assert path.read_bytes() == before
        assert "dropped the save of session disk-a" in stack.proxy_log()
        health = requests.get(stack.url + "/health", timeout=10).json()
        assert health["status"] == "degraded" and "could not save" in health["disk"], health
        # disk-a comes back from its older file; saving disk-b into its own file still works
        assert ask(client, "disk-a")["x-kvproxy-cache"] == "restored"
        assert path.read_bytes() == before
        claude = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
        answer = claude.messages.create(model="any", max_tokens=4, system=SYSTEM,
                                        messages=[{"role": "user", "content": "Name a colour."}],
                                        extra_headers={"X-Session-Id": "disk-b"})
        assert answer.type == "message"
        assert path.read_bytes() == before           # disk-a's save was dropped again
    finally:
        blocker.rmdir()
    assert ask(client, "disk-a")["x-kvproxy-cache"] == "restored"   # the slot held disk-b
    assert ask(client, "disk-b")["x-kvproxy-cache"] == "restored"
    assert json.loads(path.with_suffix(".json").read_text())["saved_at"] != saved_at, \
        "saves work again"


def test_a_truncated_file_is_moved_aside_and_the_session_starts_fresh(stack, client):
    ask(client, "torn")
    ask(client, "disk-a")                        # torn is saved
    path = files(stack)["torn"]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert ask(client, "torn")["x-kvproxy-cache"] in ("miss", "base")
    assert list((stack.slot_dir / "quarantine").glob(path.stem + ".*" + path.suffix))
    assert "not restoring " + path.stem in stack.proxy_log()


# -- start-up checks ------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("contract")
    server = LlamaServer(str(tmp / "llama-slots"), log_path=str(tmp / "llama.log")).start()
    yield server
    server.stop()


def test_a_proxy_over_another_folder_refuses_to_start_with_one_line(llama, tmp_path):
    proxy = ProxyServer(llama.url, str(tmp_path / "other-slots"), log_path=str(tmp_path / "proxy.log"))
    with pytest.raises(RuntimeError, match="exited"):
        proxy.start(timeout=60)
    log = (tmp_path / "proxy.log").read_text()
    reasons = [line for line in log.splitlines() if line.startswith("kvproxy: ")]
    assert len(reasons) == 1 and "outside KVPROXY_SLOT_DIR" in reasons[0], log
    assert "Traceback" not in log
    probes = list((tmp_path / "other-slots").glob("probe.*"))
    assert not probes


def test_health_reports_the_mismatch_when_kvproxy_starts_first(tmp_path):
    port = free_port()
    slot_dir = tmp_path / "kvproxy-slots"
    env = {**os.environ, "KVPROXY_UPSTREAM": f"http://127.0.0.1:{port}",
           "KVPROXY_SLOT_DIR": str(slot_dir), "KVPROXY_PORT": str(free_port())}
    url = f"http://127.0.0.1:{env['KVPROXY_PORT']}/health"
    with open(tmp_path / "proxy.log", "wb") as log:
        proxy = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"],
                                 cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    llama_server = LlamaServer(str(tmp_path / "llama-slots"), port=port)
    try:
        reply = poll(url, lambda r: r is not None)
        assert reply.status_code == 503 and reply.json()["status"] == "unavailable"
        llama_server.start()
        reply = poll(url, lambda r: r is not None and r.json().get("status") == "misconfigured")
        assert reply.status_code == 503 and "outside KVPROXY_SLOT_DIR" in reply.json()["error"]
    finally:
        llama_server.stop()
        stop_process(proxy, 30)


def poll(url, done, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = requests.get(url, timeout=5)
        except requests.RequestException:
            reply = None
        if done(reply) or time.monotonic() > deadline:
            return reply
        time.sleep(0.3)


def test_the_probe_is_harmless_and_slot_saving_off_is_named(llama, tmp_path):
    """A probe save leaves the slot as it was; without --slot-save-path the check says so."""
    client = LlamaClient(llama.url)
    client.post_json("/v1/chat/completions", {"max_tokens": 4, "messages": [
        {"role": "user", "content": "Name a colour."}]})
    before = client.slots()[0]
    files_before = set(os.listdir(llama.slot_dir))
    switch = SlotSwitch(client, SessionStore(llama.slot_dir))
    assert contract_problem(client, switch) is None
    after = client.slots()[0]
    assert (after.get("id_task"), after.get("n_prompt_tokens")) == \
        (before.get("id_task"), before.get("n_prompt_tokens"))
    assert set(os.listdir(llama.slot_dir)) == files_before, "the probe file is deleted"

    class NoSlotSaving(LlamaServer):
        def command(self):
            command = super().command()
            at = command.index("--slot-save-path")
            return command[:at] + command[at + 2:]

    with NoSlotSaving(str(tmp_path / "unused")) as bare:
        problem = contract_problem(LlamaClient(bare.url), SlotSwitch(LlamaClient(bare.url),
                                                                      SessionStore(tmp_path)))
    assert problem and "slot saving off" in problem and json.dumps(problem).count("\\n") == 0


def test_a_llama_server_without_its_slot_listing_is_named(tmp_path):
    """llama-server --no-slots still saves and restores, but answers GET /slots with 501."""
    with LlamaServer(str(tmp_path / "slots"), extra_args=["--no-slots"]) as bare:
        client = LlamaClient(bare.url)
        problem = contract_problem(client, SlotSwitch(client, SessionStore(bare.slot_dir)))
    assert problem and "--no-slots" in problem and "\n" not in problem
