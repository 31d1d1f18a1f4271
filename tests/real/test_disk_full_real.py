"""A slot folder on a small filesystem that fills up, against the real llama-server: two
sessions alternating keep getting answers, saves that do not fit are dropped, and /health and
/api/status say so.

The slot folder is a tmpfs of a few MB (mounting needs root; the test is skipped otherwise).
The bundled model's slot files take about 23 KB a token, so a few turns fill it.
"""
import shutil
import subprocess

import openai
import pytest
import requests

from kvproxy.storage import quarantine
from kvproxy.storage.store import SessionStore
from tests.conftest import Stack, long_text

pytestmark = pytest.mark.real

SYSTEM = "You are a terse assistant. Answer in one short sentence."
SIZE_MB = 8


@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / "slots"
    folder.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs",
                                  str(folder)], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def test_two_sessions_alternating_on_a_disk_that_fills_keep_getting_answers(tmp_path,
                                                                            small_disk):
    # KVPROXY_MIN_FREE_GB keeps its default of 1 GB: capped to a tenth of the 8 MB disk.
    stack = Stack(tmp_path).start()    # its slot folder is tmp_path / "slots": the tmpfs
    try:
        assert stack.slot_dir == small_disk
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        # Most of the disk taken by something else: the first saves hit ENOSPC in llama-server.
        filler = small_disk / "filler.dat"
        filler.write_bytes(bytes(shutil.disk_usage(small_disk).free - 1024**2))
        talks = {"full-a": [], "full-b": []}
        caches = []
        for turn in range(6):
            if turn == 2:
                filler.unlink()          # room again: the budget now refuses what cannot fit
            for session, messages in talks.items():
                messages.append({"role": "user", "content": long_text(40, seed=turn) +
                                 f" Which rule comes first, {session}?"})
                raw = client.chat.completions.with_raw_response.create(
                    model="any", max_tokens=8, temperature=0,
                    extra_headers={"X-Session-Id": session},
                    messages=[{"role": "system", "content": SYSTEM}, *messages])
                assert raw.http_response.status_code == 200
                reply = raw.parse()
                caches.append((turn, session, raw.headers["x-kvproxy-cache"],
                               reply.usage.prompt_tokens_details.cached_tokens))
                messages.append({"role": "assistant",
                                 "content": reply.choices[0].message.content})
        health = requests.get(stack.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        shown = requests.get(stack.url + "/api/status?sessions=0", timeout=10).json()["disk"]
        assert shown["saves_dropped"] >= 2 and shown["problem"], shown
        assert shown["kept_free_bytes"] <= shown["total_bytes"] // 10
        log = stack.proxy_log()
        assert "dropped the save of session" in log
        assert any(cache == "restored" for _, _, cache, _ in caches[4:]), caches
        store = SessionStore(small_disk)
        for sidecar in store.sidecars():
            if sidecar.get("saved_at"):
                assert quarantine.size_problem(store, sidecar["stem"], sidecar) is None, sidecar
        assert not list(small_disk.glob("*.saving.bin"))
        print("caches:", caches, "dropped:", shown["saves_dropped"],
              "free:", shown["free_bytes"], "kept free:", shown["kept_free_bytes"])
    finally:
        stack.stop()
