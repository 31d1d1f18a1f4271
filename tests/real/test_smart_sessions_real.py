"""Issue 5 on the real llama-server: per-conversation sessions, base snapshots,
side requests, verified restores and every id source."""
import json

import openai
import pytest
import requests

from kvproxy.sessions import identity
from kvproxy.config import load_settings
from kvproxy.upstream.llama import LlamaClient
from kvproxy.relay.context import ChatCall
from kvproxy.relay.prompt import Prompt
from kvproxy.storage.store import SessionStore
from kvproxy.slots.switch import RESTORED, SlotSwitch
from tests.conftest import long_text
from tests.support import stem_of

pytestmark = pytest.mark.real

SHARED_SYSTEM = long_text(1600, seed=505)  # over 2,000 tokens


def post_chat(stack, messages, headers=None, stream=False, max_tokens=8, **extra):
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **extra}
    reply = requests.post(stack.url + "/v1/chat/completions", json=body, headers=headers or {},
                          timeout=300)
    reply.raise_for_status()
    return reply


def usage_of(reply):
    usage = reply.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def system_tokens(stack):
    return len(requests.post(stack.llama.url + "/tokenize", json={"content": SHARED_SYSTEM},
                             timeout=30).json()["tokens"])


def test_two_idless_conversations_with_one_system_prompt_keep_their_caches(stack, system_tokens):
    assert system_tokens >= 2000
    histories = {name: [{"role": "system", "content": SHARED_SYSTEM}] for name in ("one", "two")}
    sessions = {}
    for turn in range(3):
        for name, history in histories.items():
            history.append({"role": "user", "content": f"Chat {name}, turn {turn}: quote rule {turn + 1}."})
            reply = post_chat(stack, history)
            history.append(reply.json()["choices"][0]["message"])
            sessions.setdefault(name, reply.headers["X-KVProxy-Session"])
            assert reply.headers["X-KVProxy-Session"] == sessions[name]
            prompt, cached = usage_of(reply)
            if turn > 0:
                assert reply.headers["X-KVProxy-Cache"] == "restored"
                assert cached >= 0.9 * prompt, (name, turn, prompt, cached)
            elif name == "two":  # started from the base snapshot the first chat left
                assert reply.headers["X-KVProxy-Cache"] == "base"
                assert cached >= system_tokens
    assert sessions["one"] != sessions["two"] and sessions["one"].startswith("conv-")
    bases = [s for s in requests.get(stack.url + "/api/sessions", timeout=10).json()
             if s["kind"] == "base"]
    assert len(bases) == 1 and bases[0]["n_tokens"] >= system_tokens


def test_a_third_conversation_reuses_the_system_prompt(stack, system_tokens):
    # a conversation behind the same system prompt left a base snapshot (run alone, this one)
    post_chat(stack, [{"role": "system", "content": SHARED_SYSTEM},
                      {"role": "user", "content": "An opening chat."}])
    reply = post_chat(stack, [{"role": "system", "content": SHARED_SYSTEM},
                              {"role": "user", "content": "A brand new chat."}])
    prompt, cached = usage_of(reply)
    assert reply.headers["X-KVProxy-Cache"] == "base"
    assert cached >= system_tokens, (prompt, cached, system_tokens)


def test_side_requests_leave_the_conversation_alone(stack):
    chat = {"X-OpenWebUI-Chat-Id": "owui-chat-7"}
    history = [{"role": "system", "content": long_text(700, seed=77)},
               {"role": "user", "content": "Quote rule 3."}]
    reply = post_chat(stack, history, chat)
    history.append(reply.json()["choices"][0]["message"])
    task = [{"role": "user", "content": "### Task:\nGenerate a concise title for the chat."}]
    first = post_chat(stack, task, chat)
    assert first.headers["X-KVProxy-Session"] == "side"
    sidecar = next(s for s in requests.get(stack.url + "/api/sessions", timeout=10).json()
                   if s["session_id"] == "owui-chat-7")
    path = stack.slot_dir / sidecar["file"]
    before = (path.stat().st_mtime_ns, path.stat().st_size, sidecar["n_tokens"])
    for _ in range(4):
        post_chat(stack, task, chat)
        post_chat(stack, [{"role": "user", "content": "### Task:\nSuggest 3 tags."}], chat)
    assert (path.stat().st_mtime_ns, path.stat().st_size) == before[:2]
    history.append({"role": "user", "content": "And rule 4?"})
    reply = post_chat(stack, history, chat)
    prompt, cached = usage_of(reply)
    assert reply.headers["X-KVProxy-Session"] == "owui-chat-7"
    assert reply.headers["X-KVProxy-Cache"] == "restored" and cached >= 0.9 * prompt


def _saved(stack, session_id):
    return next(s for s in requests.get(stack.url + "/api/sessions", timeout=10).json()
                if s["session_id"] == session_id)


def test_file_from_another_model_is_not_restored(stack):
    messages = [{"role": "system", "content": long_text(200, seed=88)},
                {"role": "user", "content": "hi"}]
    post_chat(stack, messages, {"X-Session-Id": "foreign"})
    post_chat(stack, messages, {"X-Session-Id": "someone-else"})
    sidecar_path = stack.slot_dir / (stem_of(_saved(stack, "foreign")["file"]) + ".json")
    sidecar = json.loads(sidecar_path.read_text())
    sidecar["made_by"]["model_path"] = "/models/another-model.gguf"
    sidecar_path.write_text(json.dumps(sidecar))
    reply = post_chat(stack, messages, {"X-Session-Id": "foreign"})
    assert reply.headers["X-KVProxy-Cache"] != "restored"
    assert "another-model.gguf" in _saved(stack, "foreign")["refused"]
    assert "not restoring" in stack.proxy_log()


def test_restore_that_llama_server_does_not_honour_is_detected(stack):
    """The prompt starts with the restored tokens and the answer reuses none of them: counted.

    SmolLM2 honours restores, so the answer is asked with ``cache_prompt: false`` (what
    sliding-window models do on their own); the switch runs in this process, over the same
    folder and lock as the stack's kvproxy, as a second kvproxy process would.
    """
    one = [{"role": "system", "content": long_text(200, seed=91)}, {"role": "user", "content": "x"}]
    two = [{"role": "system", "content": long_text(200, seed=92)}, {"role": "user", "content": "y"}]
    post_chat(stack, one, {"X-Session-Id": "honest"})
    post_chat(stack, two, {"X-Session-Id": "swapped"})      # saves "honest"
    client = LlamaClient(stack.llama.url, read_timeout=300)
    # One slot, not as many as llama-server has: its request below is pinned to slot 0.
    switch = SlotSwitch(client, SessionStore(stack.slot_dir), restore_miss_limit=1, slots=1)
    headers = {"X-Session-Id": "honest"}
    session = identity.resolve(headers, {"messages": one}, one, stream=False,
                               header_names=load_settings({}).session_headers)
    lease = switch.acquire(session, prompt=Prompt(client, ChatCall(body={"messages": one})))
    assert lease.cache == RESTORED and lease.restored_tokens > 200
    timings = client.post_json("/v1/chat/completions", {
        "messages": one, "max_tokens": 4, "id_slot": 0, "cache_prompt": False})["timings"]
    switch.release(lease, timings)
    assert timings["cache_n"] < 0.1 * lease.restored_tokens, timings
    assert _saved(stack, "honest").get("restore_not_honoured_at")
    status = requests.get(stack.url + "/api/sessions/current", timeout=10).json()["restore_check"]
    assert status["restoring_off"] and status["off_until"]
    reset = requests.post(stack.url + "/api/sessions/restore-check/reset", json={}, timeout=10)
    assert reset.status_code == 200 and not reset.json()["restoring_off"]
    reply = post_chat(stack, two, {"X-Session-Id": "swapped"})
    assert reply.headers["X-KVProxy-Cache"] == "restored"


@pytest.mark.parametrize("headers,extra,expected", [
    ({"X-OpenWebUI-Chat-Id": "owui-1"}, {}, "owui-1"),
    ({"x-claude-code-session-id": "cc-1"}, {}, "cc-1"),
    ({}, {"metadata": {"user_id": "user_x_session_9"}}, "user_x_session_9"),
    ({}, {"prompt_cache_key": "pck-1"}, "pck-1"),
    ({}, {"user": "agent-7"}, "agent-7"),
])
def test_each_new_id_source_selects_the_session(stack, headers, extra, expected):
    reply = post_chat(stack, [{"role": "user", "content": "hi"}], headers, max_tokens=2, **extra)
    assert reply.headers["X-KVProxy-Session"] == expected


def test_openai_sdk_sees_the_cache_headers(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
        extra_body={"prompt_cache_key": "sdk-key"})
    assert raw.headers["x-kvproxy-session"] == "sdk-key"
    assert raw.headers["x-kvproxy-cache"] == "miss"  # a new session without a system prompt
