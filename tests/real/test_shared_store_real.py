"""The shared store with the real llama-server, kvproxy under gunicorn and a real SeaweedFS:
a conversation saved on one node ends up in the bucket; that node is lost (stopped, its slot
folder deleted), and a second node with an empty slot folder carries the conversation on,
restoring it from the bucket with at least 90% of its prompt reused; another user's key with
the same session id gets nothing of it."""
from __future__ import annotations

import shutil
import time

import openai
import pytest

from conftest import Stack, long_text
from kvproxy.sessions.identity import owner_tag
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation

pytestmark = pytest.mark.real

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789ab"
KEYS = {"KVPROXY_API_KEYS": f"{ALICE}=alice,{BOB}=bob", "KVPROXY_ADMIN_TOKEN": "admin-token-store"}


def chat(stack: Stack, key: str, session: str, messages: list[dict]):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=8, temperature=0,
        extra_headers={"X-Session-Id": session})
    reply = raw.parse()
    chat.fetched = raw.headers.get("x-kvproxy-fetched")
    return (raw.headers["x-kvproxy-cache"], reply.usage.prompt_tokens_details.cached_tokens,
            reply.usage.prompt_tokens, reply.choices[0].message.content)


def uploaded(bucket: Bucket, user: str, timeout: float = 90) -> list[str]:
    """The user's session objects in the bucket, once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [k for k, _ in bucket.keys(bucket.location.sessions(user))]
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"no session of {user} reached the bucket within {timeout} s")


def test_a_conversation_saved_on_a_lost_node_resumes_from_the_store_on_another(
        tmp_path, store_url):
    bucket = Bucket(StoreLocation.parse(store_url), 10)
    env = {"KVPROXY_STORE_URL": store_url, **KEYS}
    system = {"role": "system", "content": "You answer in one short sentence."}
    opening = {"role": "user", "content": "Here are my notes:\n" + long_text(900, seed=3801)}

    first = Stack(tmp_path / "a", llama_args={"cache_ram_mib": 0}, **env).start()
    try:
        _, _, first_prompt, answer = chat(first, ALICE, "resume-1", [system, opening])
        assert first_prompt > 1000
        [name] = uploaded(bucket, owner_tag("alice"))
        chunks = [k for k, _ in bucket.keys(bucket.location.user_prefix(owner_tag("alice")) +
                                            "chunks/")]
        assert len(chunks) >= first_prompt // 256 - 1, chunks
        assert "resume-1" in name
    finally:
        first.stop()
    shutil.rmtree(first.slot_dir)   # the node is lost with its disk

    second = Stack(tmp_path / "b", llama_args={"cache_ram_mib": 0}, **env).start()
    try:
        follow = [system, opening, {"role": "assistant", "content": answer},
                  {"role": "user", "content": "And the second rule, in a word?"}]
        other, other_cached, _, _ = chat(second, BOB, "resume-1", follow)
        assert other != "restored" and other_cached < 64, "nothing of another user's"
        assert chat.fetched is None
        cache, cached, total, _ = chat(second, ALICE, "resume-1", follow)
        assert cache == "restored" and cached >= 0.9 * total, (cache, cached, total)
        assert chat.fetched and chat.fetched.startswith("store; ms="), chat.fetched
        cache, _, _, _ = chat(second, ALICE, "resume-1", follow + [
            {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Thanks."}])
        assert cache == "hit" and chat.fetched is None, "only the turn that fetched says so"
        log = second.proxy_log()
        assert "fetched " in log and "from the shared store" in log
    finally:
        second.stop()


def test_a_new_conversation_on_a_fresh_node_starts_from_a_base_its_user_stored(
        tmp_path, store_url):
    """A long system prompt's base snapshot (one per user with API keys, as on one node),
    made on one node, is fetched by a node that never saw the prompt when a new conversation
    of that user behind it arrives there; another user's is not."""
    bucket = Bucket(StoreLocation.parse(store_url), 10)
    env = {"KVPROXY_STORE_URL": store_url, **KEYS}
    system = {"role": "system", "content": "Rules of the house:\n" + long_text(700, seed=3802)}
    first = Stack(tmp_path / "a", llama_args={"cache_ram_mib": 0}, **env).start()
    try:
        cache, _, prompt, _ = chat(first, ALICE, "base-1",
                                   [system, {"role": "user", "content": "Rule one?"}])
        assert cache == "miss" and prompt > 700
        deadline = time.monotonic() + 90
        while not any(name.rpartition("/")[2].startswith("base.")
                      for name in uploaded(bucket, owner_tag("alice"))):
            assert time.monotonic() < deadline, "the base snapshot never reached the bucket"
            time.sleep(0.5)
    finally:
        first.stop()

    second = Stack(tmp_path / "b", llama_args={"cache_ram_mib": 0}, **env).start()
    try:
        cache, cached, _, _ = chat(second, BOB, "base-2",
                                   [system, {"role": "user", "content": "Rule two?"}])
        assert cache == "miss" and cached < 64 and chat.fetched is None, "not another's base"
        cache, cached, total, _ = chat(second, ALICE, "base-3",
                                       [system, {"role": "user", "content": "Rule three?"}])
        assert cache == "base" and cached >= 0.9 * total, (cache, cached, total)
        assert chat.fetched and chat.fetched.startswith("store; ms="), chat.fetched
    finally:
        second.stop()
