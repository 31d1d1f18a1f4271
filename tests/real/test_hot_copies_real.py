"""Hot copies against the real llama-server: it saves through a link into the hot folder and
restores from there, the copy is the file the chunks put together, and it outlives a restart
of both processes."""
from __future__ import annotations

import time

import openai
import pytest
import requests

from conftest import Stack, long_text
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.store import SessionStore

pytestmark = pytest.mark.real

SYSTEM = {"role": "system", "content": long_text(600, seed=4101)}   # about 800 tokens


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hot")
    s = Stack(tmp, llama_args={"cache_ram_mib": 0}, KVPROXY_HOT_DIR=str(tmp / "hot"),
              KVPROXY_SAVE_BEHIND_DELAY="0.5").start()
    s.hot_dir = tmp / "hot"
    yield s
    s.stop()


def chat(stack, session: str, messages: list[dict]) -> tuple[str, int, int, str]:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=8, temperature=0,
        extra_headers={"X-Session-Id": session})
    reply = raw.parse()
    return (raw.headers["x-kvproxy-cache"], reply.usage.prompt_tokens_details.cached_tokens,
            reply.usage.prompt_tokens, reply.choices[0].message.content)


def hot_restores(stack) -> dict[str, float]:
    found = {}
    for line in requests.get(stack.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("kvproxy_hot_restores_total{"):
            found[line.split('"')[1]] = float(line.split()[-1])
    return found


def settled(stack, stems: int, timeout: float = 60) -> None:
    """Wait until ``stems`` sessions are stored as chunks with no save in flight."""
    folder = stack.slot_dir
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(folder.glob("*.chunked"))) >= stems and not list(folder.glob("*.bin")):
            return
        time.sleep(0.3)
    raise AssertionError(f"{stems} sessions were not stored as chunks within {timeout} s")


def test_conversations_restore_from_their_hot_copies_which_outlive_a_restart(stack):
    turns = {name: [SYSTEM, {"role": "user", "content": f"{name}: " + long_text(30, seed=n)}]
             for n, name in enumerate(("hot-a", "hot-b"))}
    for name, messages in turns.items():
        chat(stack, name, messages)
    settled(stack, 2)
    assert not [p for p in stack.slot_dir.iterdir() if p.is_symlink()]
    assert len(list(stack.hot_dir.glob("*.bin"))) >= 2

    # the hot copy is byte for byte the file the chunks put together
    files = ChunkedFiles(SessionStore(stack.slot_dir))
    for copy in stack.hot_dir.glob("*.bin"):
        stem = copy.name.rsplit(".", 2)[0]
        with files.staged(stem) as name:
            assert (stack.slot_dir / name).read_bytes() == copy.read_bytes(), stem

    before = hot_restores(stack).get("hot", 0)
    for name, messages in turns.items():   # each swaps the other out and itself back in
        messages += [{"role": "assistant", "content": "Yes."},
                     {"role": "user", "content": "And then?"}]
        cache, cached, total, _ = chat(stack, name, messages)
        assert cache == "restored" and cached >= 0.9 * total, (name, cache, cached, total)
    assert hot_restores(stack).get("hot", 0) >= before + 2
    settled(stack, 2)

    stack.stop()
    stack.start()
    for name, messages in turns.items():
        messages += [{"role": "assistant", "content": "Yes."},
                     {"role": "user", "content": "Once more?"}]
        cache, cached, total, _ = chat(stack, name, messages)
        assert cache == "restored" and cached >= 0.9 * total, (name, cache, cached, total)
    assert hot_restores(stack).get("hot", 0) >= 1, "the copies in memory outlived the restart"
    assert "assembled" not in hot_restores(stack) or hot_restores(stack)["assembled"] == 0
