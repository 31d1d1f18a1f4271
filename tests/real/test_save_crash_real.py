"""A save killed between its two renames, against the real llama-server: after the start-up
sweep the session restores its newest state, and every file matches its sidecar.

kvproxy is killed with SIGKILL (no exit save), then a separate process saves the slot the way
a swap does and is killed with SIGKILL right after the new file is renamed in, before its
sidecar is. llama-server is restarted (the slot is empty) and kvproxy started over the folder.
"""
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from kvproxy.launch.processes import REPO_ROOT
from kvproxy.slots.state import SlotTable
from kvproxy.storage import quarantine
from kvproxy.storage.store import SessionStore
from tests.conftest import Stack, long_text

pytestmark = pytest.mark.real

SYSTEM = "You are a terse assistant. Answer in one short sentence."

CHILD = r"""
import os, signal, sys
from kvproxy.slots.switch import SlotSwitch
from kvproxy.storage.store import SessionStore
from kvproxy.upstream.llama import LlamaClient

url, slot_dir = sys.argv[1], sys.argv[2]
switch = SlotSwitch(LlamaClient(url), SessionStore(slot_dir), slots=1)  # it saves slot 0 by hand
real_replace = os.replace


def replace(src, dst):
    real_replace(src, dst)
    if str(src).endswith(".saving.bin"):     # the new file is in, its sidecar is not
        os.kill(os.getpid(), signal.SIGKILL)


os.replace = replace
with switch.holding(30) as held:
    assert held
    state = switch.table.get(0)
    print("saving", state.session_id, state.tokens, flush=True)
    switch.save_held(0, state, switch.current_made_by())
print("saved", flush=True)
"""


def ask(client, messages):
    raw = client.chat.completions.with_raw_response.create(
        model="any", max_tokens=8, temperature=0, extra_headers={"X-Session-Id": "crash-a"},
        messages=[{"role": "system", "content": SYSTEM}, *messages])
    reply = raw.parse()
    return raw.headers["x-kvproxy-cache"], reply


def other(client):
    client.chat.completions.create(
        model="any", max_tokens=4, temperature=0, extra_headers={"X-Session-Id": "crash-b"},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}])


def test_a_save_killed_between_its_renames_restores_the_newest_state(tmp_path):
    stack = Stack(tmp_path, KVPROXY_BASE_SNAPSHOTS="false").start()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        first = [{"role": "user", "content": "Name a colour."}]
        _, reply = ask(client, first)
        other(client)                                    # crash-a saved: its old state
        store = SessionStore(stack.slot_dir)
        stem = next(s["stem"] for s in store.sidecars() if s.get("session_id") == "crash-a")
        old_tokens = store.read_sidecar(stem)["n_tokens"]
        second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                          {"role": "user", "content": long_text(120, seed=7) +
                           " Which rule mentions a falcon?"}]
        cache, reply = ask(client, second)               # restored, then grows in the slot
        assert cache == "restored"
        # The turn is recorded just after its reply is sent: kill kvproxy once it is, so the
        # save below has the record to check against (a kill before it is another test).
        deadline = time.monotonic() + 30
        while SlotTable(store).get(0).tokens <= old_tokens:
            assert time.monotonic() < deadline, "the second turn was never recorded"
            time.sleep(0.05)
        os.killpg(stack.proxy.process.pid, signal.SIGKILL)   # no exit save
        stack.proxy.process.wait(10)

        result = subprocess.run([sys.executable, "-c", CHILD, stack.llama.url,
                                 str(stack.slot_dir)], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == -9 and "saving crash-a" in result.stdout, result.stderr
        temps = list(stack.slot_dir.glob(f".{stem}.json.*.tmp"))
        assert len(temps) == 1, "killed between the renames: the new sidecar is not in place"
        new_tokens = json.loads(temps[0].read_text())["n_tokens"]
        assert new_tokens > old_tokens
        assert quarantine.size_problem(store, stem, store.read_sidecar(stem)), \
            "the old sidecar does not describe the new file"

        stack.llama.restart()                            # the slot is empty now
        stack.start_proxy()                              # start-up sweep
        assert f"finished the interrupted save of {stem}.bin" in stack.proxy_log()
        assert not (stack.slot_dir / "quarantine").exists()
        for sidecar in store.sidecars():
            if sidecar.get("saved_at"):
                assert quarantine.size_problem(store, sidecar["stem"], sidecar) is None, sidecar
        assert store.read_sidecar(stem)["n_tokens"] == new_tokens

        third = second + [{"role": "assistant", "content": reply.choices[0].message.content},
                          {"role": "user", "content": "And which one mentions a harbor?"}]
        cache, reply = ask(client, third)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cache == "restored" and cached > old_tokens, (cached, old_tokens, new_tokens)
        print("tokens: old file", old_tokens, "new file", new_tokens, "reused after restart", cached)
    finally:
        stack.stop()
