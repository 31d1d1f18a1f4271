"""Embeddings against the real llama-server with two slots (--embeddings): llama-server
ignores ``id_slot`` for them, and through kvproxy two conversations in the two idle slots
both come back from their cache after an embedding ran over both slots."""
import requests

import pytest

from kvproxy.launch.processes import LlamaServer
from tests.conftest import Stack, long_text

pytestmark = pytest.mark.real

# --pooling last: the bundled chat model has no pooling of its own, which /v1/embeddings refuses.
EMBEDDINGS = ["--embeddings", "--pooling", "last"]
LLAMA = {"ctx_size": 4096, "cache_ram_mib": 0, "extra_args": EMBEDDINGS}


def slot_marks(url):
    """Per slot: the last task it ran and the tokens it holds."""
    listing = requests.get(url + "/slots", timeout=10).json()
    return {s["id"]: (s.get("id_task"), s.get("n_prompt_tokens")) for s in listing}


def test_llama_server_runs_an_embedding_in_its_least_recently_used_slot_not_in_id_slot(
        tmp_path):
    llama = LlamaServer(str(tmp_path / "slots"), slots=2, log_path=str(tmp_path / "llama.log"),
                        **LLAMA).start()
    try:
        for slot in (0, 1):   # slot 0 runs first: it is then the least recently used
            reply = requests.post(llama.url + "/completion", json={
                "prompt": long_text(60, seed=slot), "n_predict": 2, "id_slot": slot,
                "cache_prompt": True}, timeout=120)
            reply.raise_for_status()
        before = slot_marks(llama.url)
        reply = requests.post(llama.url + "/v1/embeddings",
                              json={"input": "hello there", "id_slot": 1}, timeout=120)
        reply.raise_for_status()
        after = slot_marks(llama.url)
        changed = [slot for slot in before if before[slot] != after[slot]]
        print(f"\nembedding pinned to slot 1: before {before}, after {after}")
        assert changed == [0], "the embedding ran in the least recently used slot, not slot 1"
    finally:
        llama.stop()


def turn(url, session, history):
    reply = requests.post(url + "/v1/chat/completions", headers={"X-Session-Id": session},
                          json={"messages": history, "max_tokens": 8, "temperature": 0},
                          timeout=300)
    reply.raise_for_status()
    body = reply.json()
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return {"cache": reply.headers["X-KVProxy-Cache"], "prompt": body["usage"]["prompt_tokens"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"],
            "timings": {k: body.get("timings", {}).get(k) for k in ("cache_n", "prompt_n")}}


def test_two_conversations_keep_their_cache_across_an_embedding_over_both_slots(tmp_path):
    stack = Stack(tmp_path, slots=2, llama_args=LLAMA, KVPROXY_BASE_SNAPSHOTS="false").start()
    try:
        url = stack.url
        histories = {name: [{"role": "system", "content": long_text(200, seed=seed)},
                            {"role": "user", "content": "Rule 1?"}]
                     for name, seed in (("emb-a", 81), ("emb-b", 82))}
        first = {name: turn(url, name, history) for name, history in histories.items()}
        slots = {s["session_id"]: s["id"] for s in
                 requests.get(url + "/api/slots", timeout=10).json()}
        assert {slots["emb-a"], slots["emb-b"]} == {0, 1}
        # A RAG client embeds a batch: llama-server runs one task per input, in idle slots.
        reply = requests.post(url + "/v1/embeddings", json={
            "input": ["first passage to index", "second passage to index"]}, timeout=120)
        assert reply.status_code == 200, reply.text
        back = {}
        for name, history in histories.items():
            history.append({"role": "user", "content": "Rule 2?"})
            back[name] = turn(url, name, history)
        print(f"\nfirst turns {first}\nafter the embedding {back}")
        for name, now in back.items():
            assert now["cache"] in ("hit", "restored"), (name, now)
            assert now["cached"] >= first[name]["prompt"], \
                f"{name} computed its prompt again: {now}"
        assert "llama-server ran the side request in slot" in stack.proxy_log()
    finally:
        stack.stop()
