"""Sessions stored as shared chunks, against the real llama-server.

Files cut into chunks and put back together continue exactly as the files llama-server wrote
(greedy decoding, flash attention on and off), also when one conversation's file is put
together from another's chunks of their shared start; through kvproxy, a new conversation
starts from its user's stored conversation that holds the longest start of its prompt, and
never from another user's; Gemma 3's sliding-window cache restores from its chunks.
"""
from __future__ import annotations

import time

import openai
import pytest
import requests

from conftest import Stack, long_text
from kvproxy.launch.processes import LlamaServer, swa_model
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.chunks import manifest
from kvproxy.storage.store import SessionStore

pytestmark = pytest.mark.real

SHARED = long_text(420, seed=3701)   # about 600 tokens: two whole chunks of 256


def complete(server: LlamaServer, prompt: str, n: int = 12) -> dict:
    reply = requests.post(server.url + "/completion", timeout=300, json={
        "prompt": prompt, "n_predict": n, "temperature": 0, "id_slot": 0, "cache_prompt": True})
    reply.raise_for_status()
    return reply.json()


def slot(server: LlamaServer, action: str, name: str) -> dict:
    reply = requests.post(f"{server.url}/slots/0?action={action}", json={"filename": name},
                          timeout=300)
    reply.raise_for_status()
    return reply.json()


def continuation(server: LlamaServer, name: str, prompt: str) -> tuple[str, int]:
    """Restore ``name`` and continue ``prompt`` greedily: the text and the tokens reused."""
    requests.post(f"{server.url}/slots/0?action=erase", timeout=60).raise_for_status()
    slot(server, "restore", name)
    answer = complete(server, prompt)
    return answer["content"], answer["timings"]["cache_n"]


@pytest.mark.parametrize("flash", ["on", "off"])
def test_files_put_together_from_shared_chunks_continue_exactly_as_their_own(tmp_path, flash):
    server = LlamaServer(str(tmp_path / "slots"), extra_args=["-fa", flash],
                         log_path=str(tmp_path / "llama.log")).start()
    try:
        store = SessionStore(tmp_path / "slots")
        files = ChunkedFiles(store)
        prompts = {stem: SHARED + f"\n\nQuestion {stem}: " + long_text(40, seed=n)
                   for n, stem in enumerate(("a", "b"))}
        own = {}
        for stem, prompt in prompts.items():
            complete(server, prompt, n=1)
            saved = slot(server, "save", f"{stem}.bin")
            whole = (tmp_path / "slots" / f"{stem}.bin").read_bytes()
            own[stem] = continuation(server, f"{stem}.bin", prompt + " Answer:")
            assert saved["n_written"] == len(whole)
            assert files.pack(stem, {"model_path": "m"}) > 0
            assert not store.bin_path(stem).exists()
            with files.staged(stem) as name:
                assert (tmp_path / "slots" / name).read_bytes() == whole, "byte for byte"
        keys = {stem: manifest.read_keys(store.chunked_path(stem)) for stem in prompts}
        assert len(keys["a"]) >= 2 and keys["a"][:2] == keys["b"][:2], "the start is shared"
        assert sum(1 for _ in files.chunks.keys()) < len(keys["a"]) + len(keys["b"])
        for stem, prompt in prompts.items():
            with files.staged(stem) as name:
                text, reused = continuation(server, name, prompt + " Answer:")
            assert (text, reused) == own[stem], stem
            assert reused > 500
    finally:
        server.stop()


# -- through kvproxy -----------------------------------------------------------------
ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789ab"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chunks")
    s = Stack(tmp, llama_args={"cache_ram_mib": 0},
              KVPROXY_API_KEYS=f"{ALICE}=alice,{BOB}=bob",
              KVPROXY_ADMIN_TOKEN="admin-token-chunks").start()
    yield s
    s.stop()


def chat(stack, key: str, session: str, messages: list[dict]):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=8, temperature=0,
        extra_headers={"X-Session-Id": session})
    reply = raw.parse()
    return raw.headers["x-kvproxy-cache"], reply.usage.prompt_tokens_details.cached_tokens, \
        reply.usage.prompt_tokens


def saved(stack, key: str, session: str, timeout: float = 60) -> dict:
    """The session's listing once its save is stored as chunks (the cut follows the save)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listing = requests.get(stack.url + "/api/sessions", timeout=30,
                               headers={"Authorization": f"Bearer {key}"}).json()
        found = [s for s in listing if s.get("session_id") == session
                 and s.get("stored_as") == "chunks"]
        if found:
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"{session} was not saved within {timeout} s")


def test_a_new_conversation_starts_from_its_users_longest_stored_start(stack):
    system = {"role": "system", "content": "You answer in one short sentence."}
    opening = {"role": "user", "content": "Here are my notes:\n" + long_text(500, seed=3702)}
    chat(stack, ALICE, "notes-1", [system, opening])
    first = saved(stack, ALICE, "notes-1")
    assert first["chunks"] >= 2
    follow = [system, opening, {"role": "assistant", "content": "Noted."},
              {"role": "user", "content": "What is the first word of my notes?"}]
    cache, cached, total = chat(stack, ALICE, "notes-2", follow)
    assert cache == "restored", "started from notes-1, which holds the start of its prompt"
    assert cached >= first["n_tokens"] - 300 and cached > 256, (cached, total, first)
    assert "starts from" in stack.proxy_log()

    # bob sends the very same conversation: nothing of alice's is restored or reused
    cache, cached, total = chat(stack, BOB, "notes-3", follow)
    assert cache != "restored" and cached < 64, (cache, cached, total)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma-chunks")
    s = Stack(tmp, model=swa_model()).start()
    yield s
    s.stop()


def test_gemma_3_sessions_are_stored_as_chunks_and_restored(gemma):
    system = {"role": "system", "content": long_text(400, seed=3703)}
    for session in ("g-a", "g-b"):
        chat(gemma, "unused", session, [system, {"role": "user", "content": f"Hi from {session}"}])
    entry = saved(gemma, "unused", "g-a")
    assert entry["chunks"] >= 1
    cache, cached, total = chat(gemma, "unused", "g-a",
                                [system, {"role": "user", "content": "Hi from g-a"},
                                 {"role": "assistant", "content": "Hello."},
                                 {"role": "user", "content": "Again?"}])
    assert cache == "restored" and cached >= 0.9 * (entry["n_tokens"] or 0), (cached, total, entry)
