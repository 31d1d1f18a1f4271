"""The slot folder's disk bound on the real llama-server: the least recently used files go."""
import pytest
import requests

from kvproxy.storage.store import SessionStore

from tests.conftest import Stack, long_text
from tests.support import stem_of

pytestmark = pytest.mark.real

# SmolLM2-135M's slot files take about 23 KB a token: each session below saves about 7 MB,
# and the bound keeps two or three of them.
BOUND_GB = 0.018
SESSIONS = [f"evict-{n}" for n in range(5)]


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("evict"), KVPROXY_MAX_DISK_GB=str(BOUND_GB),
              KVPROXY_BASE_SNAPSHOTS="false").start()
    yield s
    s.stop()


def ask(stack, n: int) -> requests.Response:
    reply = requests.post(stack.url + "/v1/chat/completions", timeout=300,
                          headers={"X-Session-Id": SESSIONS[n]},
                          json={"model": "m", "max_tokens": 4, "temperature": 0, "messages": [
                              {"role": "system", "content": long_text(200, seed=700 + n)},
                              {"role": "user", "content": "Quote rule 1."}]})
    reply.raise_for_status()
    return reply


def evictions(stack) -> float:
    for line in requests.get(stack.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvproxy_evictions_total "):
            return float(line.split()[1])
    return 0.0


def test_oldest_files_are_evicted_to_keep_the_folder_within_its_bound(small_stack):
    for n in range(len(SESSIONS)):
        assert ask(small_stack, n).headers["X-KVProxy-Cache"] == "miss"
    on_disk = {s["session_id"]: s for s in
               requests.get(small_stack.url + "/api/sessions", timeout=10).json()
               if s.get("saved_at")}  # the last session has a sidecar but no file yet
    total = sum(p.stat().st_size for p in small_stack.slot_dir.rglob("*") if p.is_file())
    assert total <= BOUND_GB * 1024**3
    gone = [s for s in SESSIONS[:-1] if s not in on_disk]   # the last one was never saved
    assert gone and gone == SESSIONS[:len(gone)], (gone, sorted(on_disk))
    assert evictions(small_stack) == len(gone)
    for sidecar in on_disk.values():
        stem = stem_of(sidecar["file"])
        assert SessionStore(small_stack.slot_dir).bin_bytes(stem) == sidecar["n_bytes"]
    # an evicted session starts empty; the newest file comes back
    assert ask(small_stack, 0).headers["X-KVProxy-Cache"] == "miss"
    assert ask(small_stack, len(SESSIONS) - 1).headers["X-KVProxy-Cache"] == "restored"
