"""Streamed answers on every API, llama-server stubbed.

A stream holds the slot until its last byte: afterwards the slot must be free
(or every later request waits out the lock bound), and the timings on the last
chunk must be recorded as for a whole answer (base snapshots, restore checks,
slot tokens, token counts), because OpenWebUI and Claude Code always stream.
"""
from __future__ import annotations

import json

import pytest
import responses
from prometheus_client.parser import text_string_to_metric_families

from kvproxy import create_app
from tests.fake_llama import UPSTREAM, FakeLlama

SYSTEM = "You are a terse assistant for the lighthouse keepers' union."
OTHER_SYSTEM = "You answer in rhymes about the weather."


def route_request(route: str, system: str, text: str = "hi") -> tuple[str, dict]:
    """Path and body of one streamed request on ``route``."""
    user = [{"role": "user", "content": text}]
    if route == "openai-chat":
        return "/v1/chat/completions", {"model": "m", "stream": True,
                                        "messages": [{"role": "system", "content": system}, *user]}
    if route == "openai-text":
        return "/v1/completions", {"model": "m", "stream": True, "prompt": f"{system}\n{text}"}
    if route == "ollama-chat":  # Ollama streams unless told not to
        return "/api/chat", {"model": "tiny", "messages": [{"role": "system", "content": system},
                                                           *user]}
    if route == "ollama-generate":
        return "/api/generate", {"model": "tiny", "system": system, "prompt": text}
    if route == "anthropic":
        return "/v1/messages", {"model": "claude", "max_tokens": 8, "stream": True,
                                "system": system, "messages": user}
    raise AssertionError(route)


ROUTES = ["openai-chat", "openai-text", "ollama-chat", "ollama-generate", "anthropic"]
ROUTES_WITH_SYSTEM = [r for r in ROUTES if r != "openai-text"]


def templated(messages: list[dict], generation_prompt: bool = True) -> str:
    """The stub's chat template: role tags around each message."""
    text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
    return text + ("<assistant>" if generation_prompt else "")


def tokens_of(text: str) -> list[int]:
    """The stub's tokenizer: one token per character."""
    return [ord(c) for c in text]


@pytest.fixture
def fake(tmp_path):
    """llama-server stubbed, with a template and a tokenizer: base snapshots prefill the system
    prompt alone and the restore check compares token prefixes, so both need them."""
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.add_callback(responses.POST, f"{UPSTREAM}/apply-template", callback=lambda r: (
            200, {}, json.dumps({"prompt": templated(json.loads(r.body)["messages"],
                                                     json.loads(r.body)["add_generation_prompt"])})))
        mock.add_callback(responses.POST, f"{UPSTREAM}/tokenize", callback=lambda r: (
            200, {}, json.dumps({"tokens": tokens_of(json.loads(r.body)["content"])})))
        yield FakeLlama(mock, tmp_path)


def make_app(tmp_path, **settings):
    return create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 0.3,
                       **settings})


def stream(client, route: str, session: str, system: str = SYSTEM, text: str = "hi", **kwargs):
    path, body = route_request(route, system, text)
    reply = client.post(path, json=body, headers={"X-Session-Id": session}, **kwargs)
    assert reply.status_code == 200, reply.get_data(as_text=True)
    return reply


def scraped(client, name: str, **labels: str) -> float:
    """One sample from GET /metrics (0 when absent)."""
    text = client.get("/metrics").get_data(as_text=True)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


@pytest.mark.parametrize("route", ROUTES)
def test_the_slot_is_free_after_a_streamed_answer(tmp_path, fake, route):
    app = make_app(tmp_path)
    client = app.test_client()
    first = stream(client, route, "first")
    assert first.headers["X-KVProxy-Cache"] == "miss" and first.get_data()
    before = len(fake.actions)
    # lock_timeout is 0.3 s: a slot still held would answer 503 here
    second = stream(client, route, "second")
    assert second.headers["X-KVProxy-Session"] == "second"
    saves = [file for action, file in fake.actions[before:] if action == "save"]
    [first_file] = [s["file"] for s in client.get("/api/sessions").get_json()
                    if s["session_id"] == "first"]
    assert saves[:1] == [first_file.replace(".bin", ".saving.bin")], \
        "the second session swapped the first one out"
    assert (tmp_path / first_file).is_file()


@pytest.mark.parametrize("route", ROUTES)
def test_the_slot_is_free_after_a_client_leaves_mid_stream(tmp_path, fake, route):
    app = make_app(tmp_path)
    client = app.test_client()
    reply = stream(client, route, "leaver", buffered=False)
    next(iter(reply.response))  # the first chunk, then the client goes away
    reply.close()
    assert stream(client, route, "next").headers["X-KVProxy-Session"] == "next"


@pytest.mark.parametrize("route", ROUTES)
def test_a_streamed_answer_counts_tokens_and_records_slot_tokens(tmp_path, fake, route):
    app = make_app(tmp_path)
    client = app.test_client()
    fake.chat_timings = {"cache_n": 7, "prompt_n": 120, "predicted_n": 5}
    before = (scraped(client, "kvproxy_prompt_tokens_total", kind="computed"),
              scraped(client, "kvproxy_prompt_tokens_total", kind="reused"))
    stream(client, route, "counted")
    prefilled = sum(len(p) for p in fake.prefills)  # a base snapshot's system prompt, if made
    assert scraped(client, "kvproxy_prompt_tokens_total", kind="computed") == \
        before[0] + 120 + prefilled
    # reused tokens that the swap's own base prefill computed were computed for this request
    assert scraped(client, "kvproxy_prompt_tokens_total", kind="reused") == \
        before[1] + 7 - min(7, prefilled)
    assert scraped(client, "kvproxy_slot_tokens") == 132


@pytest.mark.parametrize("route", ROUTES_WITH_SYSTEM)
def test_a_streamed_first_answer_makes_the_base_snapshot(tmp_path, fake, route):
    client = make_app(tmp_path).test_client()
    stream(client, route, "one")
    bases = [s for s in client.get("/api/sessions").get_json() if s["kind"] == "base"]
    assert len(bases) == 1 and (tmp_path / bases[0]["file"]).is_file()
    assert stream(client, route, "two").headers["X-KVProxy-Cache"] == "base"


@pytest.mark.parametrize("route", ROUTES_WITH_SYSTEM)
def test_a_streamed_answer_verifies_the_restore(tmp_path, fake, route):
    """A restore whose streamed answer reuses nothing is counted, and with a limit of one
    switches restoring off."""
    client = make_app(tmp_path, base_snapshots=False, restore_miss_limit=1).test_client()
    fake.chat_timings = {"cache_n": 0, "prompt_n": 200, "predicted_n": 2}
    # the saved slot holds the first turn's tokens: the next prompt starts with them
    first_turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    fake.slot_token_ids = tokens_of(templated(first_turn) + "ok") + [0] * 300
    stream(client, route, "kept")                        # 202 tokens in the slot
    stream(client, route, "other", system=OTHER_SYSTEM)  # kept saved with 202 tokens
    before = scraped(client, "kvproxy_restore_misses_total", reason="not_honoured")
    restored = stream(client, route, "kept", text="hi again")
    assert restored.headers["X-KVProxy-Cache"] == "restored"
    assert scraped(client, "kvproxy_restore_misses_total", reason="not_honoured") == before + 1
    stream(client, route, "other", system=OTHER_SYSTEM)
    assert stream(client, route, "kept", text="third").headers["X-KVProxy-Cache"] == "miss"


def test_the_anthropic_stream_ends_with_message_stop_on_the_wire(tmp_path, fake):
    """Anthropic's SDK tolerates a stream without message_stop; other clients wait for it."""
    reply = stream(make_app(tmp_path).test_client(), "anthropic", "wire")
    names = [line.removeprefix("event: ") for line in reply.get_data(as_text=True).splitlines()
             if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
