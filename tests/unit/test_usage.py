"""Usage figures count a base snapshot's prefill as computed by the request that made it
(llama-server stubbed): the arithmetic, every API's fields streamed and whole, and the
status page and metrics agreeing with them. A later conversation that restores the base
reports it as cached."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import responses
from prometheus_client.parser import text_string_to_metric_families

from kvproxy import create_app
from kvproxy.slots.executor import Prefill
from kvproxy.slots.lease import Lease
from kvproxy.translate import usage
from tests.fake_llama import UPSTREAM, FakeLlama

SYSTEM = "You keep the lighthouse log: " + "tide, lamp, fog horn and weather, " * 4


# -- the arithmetic ------------------------------------------------------------------
def test_the_tokens_a_prefill_computed_move_from_reused_to_computed_with_their_time():
    timings = {"cache_n": 100, "prompt_n": 5, "prompt_ms": 10.0, "prompt_per_token_ms": 2.0,
               "prompt_per_second": 500.0, "predicted_n": 2, "predicted_ms": 4.0}
    told = Prefill(100, 0, 50.0).timings(timings)
    assert told == {"cache_n": 0, "prompt_n": 105, "prompt_ms": 60.0,
                    "prompt_per_token_ms": 60.0 / 105, "prompt_per_second": 1000.0 * 105 / 60,
                    "predicted_n": 2, "predicted_ms": 4.0}
    assert timings["cache_n"] == 100, "llama-server's own timings are left as they were"


def test_what_the_prefill_found_cached_stays_reused():
    """llama-server's RAM cache served 30 of the base's 100 tokens: only 70 were computed."""
    prefill = Prefill(70, 30, 7.0)
    assert prefill.timings({"cache_n": 120, "prompt_n": 3}) == {"cache_n": 50, "prompt_n": 73}
    assert prefill.moved(20) == 0 and prefill.moved(60) == 30


def test_only_what_the_request_reused_of_the_prefill_moves():
    assert Prefill(100).moved(60) == 60
    assert Prefill(100).timings({"cache_n": 0, "prompt_n": 150}) == {"cache_n": 0, "prompt_n": 150}


def test_a_lease_without_a_prefill_reports_llama_servers_figures():
    lease = Lease(SimpleNamespace(id="A"), "base", restored_tokens=100)
    timings = {"cache_n": 100, "prompt_n": 5}
    assert lease.figures(timings) is timings
    made = Lease(SimpleNamespace(id="A"), "miss", 100, prefill=Prefill(100, 0, 9.0))
    assert made.figures(timings) == {"cache_n": 0, "prompt_n": 105}


def test_openai_usage_loses_the_cached_tokens_the_prefill_computed():
    answer = {"usage": {"prompt_tokens": 105, "completion_tokens": 2, "total_tokens": 107,
                        "prompt_tokens_details": {"cached_tokens": 100}},
              "timings": {"cache_n": 100, "prompt_n": 5}}
    told = usage.honest(answer, Prefill(100, 0, 9.0))
    assert told["usage"] == {"prompt_tokens": 105, "completion_tokens": 2, "total_tokens": 107,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert told["timings"] is answer["timings"], "relayed timings are llama-server's own"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 100
    translated = usage.honest(answer, Prefill(100, 0, 9.0), timings=True)
    assert translated["timings"] == {"cache_n": 0, "prompt_n": 105}


def test_the_responses_api_usage_too_whole_and_streamed():
    whole = {"usage": {"input_tokens": 105, "output_tokens": 2,
                       "input_tokens_details": {"cached_tokens": 100}}}
    assert usage.honest(whole, Prefill(90))["usage"]["input_tokens_details"] == \
        {"cached_tokens": 10}
    event = {"type": "response.completed", "response": {"id": "r", "usage": whole["usage"]}}
    told = usage.honest(event, Prefill(90))
    assert told["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 10
    assert told["response"]["id"] == "r"
    raw = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
    assert usage.reencoded(raw, {"a": "\u00e9"}) == \
        'event: response.completed\ndata: {"a":"\u00e9"}\n\n'.encode()
    assert usage.reencoded(b'data: {"a":1}\n\n', {"a": 2}) == b'data: {"a":2}\n\n'


@pytest.mark.parametrize("obj", [
    {"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}},
    {"choices": [{"delta": {"content": "x"}}]}, None, [1], {"usage": "odd"},
    {"usage": {"prompt_tokens_details": {"cached_tokens": True}}}])
def test_nothing_to_move_leaves_the_object_itself(obj):
    assert usage.honest(obj, Prefill(100), timings=True) is obj
    assert usage.honest({"usage": {"prompt_tokens_details": {"cached_tokens": 100}}}, None) \
        == {"usage": {"prompt_tokens_details": {"cached_tokens": 100}}}


# -- every API, through kvproxy ------------------------------------------------------
def templated(messages: list[dict], generation_prompt: bool = True) -> str:
    """The stub's chat template: role tags around each message."""
    text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
    return text + ("<assistant>" if generation_prompt else "")


BASE_TOKENS = len(templated([{"role": "system", "content": SYSTEM}], False))  # one a character
FIRST = {"cache_n": BASE_TOKENS, "prompt_n": 5, "prompt_ms": 20.0, "predicted_n": 2,
         "predicted_ms": 8.0}     # llama-server reused the base the swap had just prefilled
LATER = {**FIRST, "prompt_n": 7}  # a later conversation restored the base


@pytest.fixture
def fake(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.add_callback(responses.POST, f"{UPSTREAM}/apply-template", callback=lambda r: (
            200, {}, json.dumps({"prompt": templated(json.loads(r.body)["messages"],
                                                     json.loads(r.body)["add_generation_prompt"])})))
        mock.add_callback(responses.POST, f"{UPSTREAM}/tokenize", callback=lambda r: (
            200, {}, json.dumps({"tokens": [ord(c) for c in json.loads(r.body)["content"]]})))
        yield FakeLlama(mock, tmp_path)


def sse(reply) -> list[tuple[str | None, dict]]:
    events = []
    for block in reply.get_data(as_text=True).split("\n\n"):
        name = next((line[6:].strip() for line in block.splitlines()
                     if line.startswith("event:")), None)
        data = next((line[5:].strip() for line in block.splitlines()
                     if line.startswith("data:")), None)
        if data and data != "[DONE]":
            events.append((name, json.loads(data)))
    return events


def figures(api: str, stream: bool, reply) -> dict:
    """What the client is told: prompt tokens computed and cached, prompt time in ms."""
    if api == "openai":
        found = [e["usage"] for _, e in sse(reply) if e.get("usage")] if stream \
            else [reply.get_json()["usage"]]
        cached = found[-1]["prompt_tokens_details"]["cached_tokens"]
        return {"computed": found[-1]["prompt_tokens"] - cached, "cached": cached}
    if api == "anthropic":
        if stream:
            events = sse(reply)
            start = next(e for n, e in events if n == "message_start")["message"]["usage"]
            delta = next(e for n, e in events if n == "message_delta")["usage"]
            assert {**start, "output_tokens": 0} == {**delta, "output_tokens": 0}, \
                "message_start and message_delta agree"
        else:
            delta = reply.get_json()["usage"]
        return {"computed": delta["input_tokens"], "cached": delta["cache_read_input_tokens"]}
    lines = [json.loads(line) for line in reply.get_data(as_text=True).splitlines() if line]
    done = lines[-1]
    assert done["done"] is True
    return {"computed": done["prompt_eval_count"], "ms": done["prompt_eval_duration"] / 1e6}


def request(client, api: str, stream: bool, session: str):
    user = [{"role": "user", "content": f"hello from {session}"}]
    headers = {"X-Session-Id": session}
    if api == "openai":
        body = {"model": "m", "stream": stream,
                "messages": [{"role": "system", "content": SYSTEM}, *user]}
        if stream:
            body["stream_options"] = {"include_usage": True}
        reply = client.post("/v1/chat/completions", json=body, headers=headers)
    elif api == "anthropic":
        reply = client.post("/v1/messages", headers=headers, json={
            "model": "claude", "max_tokens": 8, "stream": stream, "system": SYSTEM,
            "messages": user})
    else:
        reply = client.post("/api/chat", headers=headers, json={
            "model": "tiny", "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, *user]})
    assert reply.status_code == 200, reply.get_data(as_text=True)
    return reply


def scraped(client, kind: str) -> float:
    text = client.get("/metrics").get_data(as_text=True)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvproxy_prompt_tokens_total" and sample.labels == {"kind": kind}:
                return sample.value
    return 0.0


def counted(client) -> dict:
    """The status page's and the metrics' token counts."""
    return {"status": client.get("/api/status").get_json()["stats"]["tokens"],
            "metrics": {kind: scraped(client, kind) for kind in ("reused", "computed")}}


def grown(before: dict, after: dict) -> dict:
    return {where: {kind: after[where][kind] - before[where][kind] for kind in after[where]}
            for where in after}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["openai", "anthropic", "ollama"])
def test_the_request_that_made_a_base_reports_it_computed_a_later_one_cached(
        tmp_path, fake, api, stream):
    client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                         "lock_timeout": 1}).test_client()
    fake.chat_timings = dict(FIRST)
    before = counted(client)
    first = request(client, api, stream, "first")
    assert first.headers["X-KVProxy-Cache"] == "miss"
    assert [len(p) for p in fake.prefills] == [BASE_TOKENS], "the swap made the base"
    told = figures(api, stream, first)
    if api == "ollama":  # the prefill's time is in the prompt's: 1 ms a token in the stub
        assert told == {"computed": BASE_TOKENS + 5, "ms": 20.0 + BASE_TOKENS}
    else:
        assert told == {"computed": BASE_TOKENS + 5, "cached": 0}
    same = {"reused": 0, "computed": BASE_TOKENS + 5}
    assert grown(before, counted(client)) == {"status": same, "metrics": same}

    fake.chat_timings = dict(LATER)
    before = counted(client)
    later = request(client, api, stream, "later")
    assert later.headers["X-KVProxy-Cache"] == "base" and len(fake.prefills) == 1
    told = figures(api, stream, later)
    if api == "ollama":
        assert told == {"computed": 7, "ms": 20.0}
    else:
        assert told == {"computed": 7, "cached": BASE_TOKENS}
    same = {"reused": BASE_TOKENS, "computed": 7}
    assert grown(before, counted(client)) == {"status": same, "metrics": same}


def test_the_prefill_found_in_llama_servers_ram_cache_stays_cached(tmp_path, fake):
    """Only what the prefill computed moves: the part llama-server's RAM cache served is
    reported as cached, by the usage, the status page and the metrics alike."""
    client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                         "lock_timeout": 1}).test_client()
    fake.prefill_reused = 30
    fake.chat_timings = dict(FIRST)
    before = counted(client)
    assert figures("openai", False, request(client, "openai", False, "first")) == \
        {"computed": BASE_TOKENS - 30 + 5, "cached": 30}
    same = {"reused": 30, "computed": BASE_TOKENS - 30 + 5}
    assert grown(before, counted(client)) == {"status": same, "metrics": same}


def test_a_relayed_answer_keeps_llama_servers_timings(tmp_path, fake):
    """OpenAI's whole answer: usage is this request's, ``timings`` what llama-server
    measured for the call kvproxy made (passed on unchanged)."""
    client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                         "lock_timeout": 1}).test_client()
    fake.chat_timings = dict(FIRST)
    reply = request(client, "openai", False, "first").get_json()
    assert reply["timings"] == FIRST
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
