"""Every API's usage fields carry the request's prompt, cached and generated token counts.

Driven by the real ``anthropic``, ``openai`` and ``ollama`` clients against kvproxy on the
real llama-server: a first turn, then a second one that reads the first from the slot; and a
first conversation that made a base snapshot (computed), then another behind it (cached).
"""
from __future__ import annotations

import anthropic
import ollama
import openai
import pytest
import requests

from conftest import count_tokens, long_text

pytestmark = pytest.mark.real


def test_anthropic_message_start_reports_the_prompt_and_cache(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=120)
    history = [{"role": "user", "content": "Name a colour."}]
    kwargs = dict(model="claude", max_tokens=8, system=long_text(300, 7),
                  extra_body={"temperature": 0},
                  extra_headers={"x-claude-code-session-id": "usage-anthropic"})
    starts, finals = [], []
    for turn in range(2):
        with client.messages.stream(messages=history, **kwargs) as stream:
            for event in stream:
                if event.type == "message_start":
                    starts.append(event.message.usage)
            finals.append(stream.get_final_message())
        history += [{"role": "assistant", "content": finals[-1].content[0].text or "ok"},
                    {"role": "user", "content": "Another one."}]
    for start, final in zip(starts, finals):
        assert start.input_tokens == final.usage.input_tokens > 0
        assert start.cache_read_input_tokens == final.usage.cache_read_input_tokens
        assert 0 < final.usage.output_tokens <= 8
    first_prompt = starts[0].input_tokens + starts[0].cache_read_input_tokens
    assert first_prompt > 300
    # the second turn reads the whole first prompt from the slot and computes only the rest
    assert starts[1].cache_read_input_tokens >= first_prompt - 2
    assert starts[1].input_tokens < 40
    print(f"\nanthropic message_start: turn 1 {starts[0]}, turn 2 {starts[1]}")


def test_openai_usage_has_cached_tokens(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)
    history = [{"role": "system", "content": long_text(300, 8)},
               {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model="m", messages=history, max_tokens=8,
                                           temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Another one."}]
    stream = client.chat.completions.create(model="m", messages=history, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage][-1]
    assert first.usage.prompt_tokens > 300 and 0 < first.usage.completion_tokens <= 8
    assert usage.prompt_tokens > first.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2
    assert 0 < usage.completion_tokens <= 8
    print(f"\nopenai: turn 1 {first.usage}, turn 2 {usage}")


def test_ollama_counts_evaluated_and_generated_tokens(stack):
    client = ollama.Client(host=stack.url, timeout=120)
    name = client.list().models[0].model
    history = [{"role": "system", "content": long_text(300, 9)},
               {"role": "user", "content": "Name a colour."}]
    first = client.chat(model=name, messages=history, options={"num_predict": 8,
                                                              "temperature": 0})
    history += [{"role": "assistant", "content": first.message.content},
                {"role": "user", "content": "Another one."}]
    parts = list(client.chat(model=name, messages=history, stream=True,
                             options={"num_predict": 8, "temperature": 0}))
    last = parts[-1]
    # the system prompt was prefilled for its base snapshot before this first answer
    assert count_tokens(stack, history[0]["content"]) > 300
    assert 0 < first.prompt_eval_count and 0 < first.eval_count <= 8
    # prompt_eval_count is what llama-server computed: the cached prefix is not counted
    assert 0 < last.prompt_eval_count < 40 and 0 < last.eval_count <= 8
    print(f"\nollama: turn 1 prompt_eval_count={first.prompt_eval_count} "
          f"eval_count={first.eval_count}; turn 2 prompt_eval_count={last.prompt_eval_count} "
          f"eval_count={last.eval_count}")


# -- a base snapshot's prefill is this request's work ----------------------------------
# The first conversation behind a never-seen system prompt makes its base snapshot: kvproxy
# computes the system prompt into the slot as a step of its own, then the request reuses it.
# Those tokens were computed for this request and are reported so; a later, different
# conversation behind the same system prompt restores the base and reports it as cached.

def bases(stack) -> dict[str, dict]:
    listing = requests.get(stack.url + "/api/sessions", timeout=30).json()
    return {s["file"]: s for s in listing if s["kind"] == "base"}


def new_base(stack, before: dict[str, dict]) -> dict:
    [made] = [s for name, s in bases(stack).items() if name not in before]
    # what the prefill found cached in llama-server (its RAM cache) stays cached
    made["found_cached"] = made["n_tokens"] - made["prefill_computed"]
    assert made["prefill_computed"] > 300
    return made


def status_tokens(stack) -> dict:
    return requests.get(stack.url + "/api/status", timeout=30).json()["stats"]["tokens"]


def test_openai_a_base_prefill_is_computed_then_cached(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)
    system = {"role": "system", "content": long_text(300, 31)}
    before, counted = bases(stack), status_tokens(stack)
    raw = client.chat.completions.with_raw_response.create(
        model="m", max_tokens=8, temperature=0,
        messages=[system, {"role": "user", "content": "Name a colour."}])
    first, base = raw.parse().usage, new_base(stack, before)
    assert raw.headers["X-KVProxy-Cache"] == "miss"
    assert first.prompt_tokens_details.cached_tokens == base["found_cached"]
    assert first.prompt_tokens - first.prompt_tokens_details.cached_tokens > base["n_tokens"] - \
        base["found_cached"], "the system prompt's tokens are computed, with the rest"
    after = status_tokens(stack)
    assert after["reused"] - counted["reused"] == first.prompt_tokens_details.cached_tokens
    assert after["computed"] - counted["computed"] == \
        first.prompt_tokens - first.prompt_tokens_details.cached_tokens

    stream = client.chat.completions.with_raw_response.create(
        model="m", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[system, {"role": "user", "content": "Name a number."}])
    assert stream.headers["X-KVProxy-Cache"] == "base"
    later = [chunk.usage for chunk in stream.parse() if chunk.usage][-1]
    assert later.prompt_tokens_details.cached_tokens == base["n_tokens"]
    assert later.prompt_tokens - later.prompt_tokens_details.cached_tokens < 40
    print(f"\nopenai: made the base {first}, behind it {later}")


def test_anthropic_a_base_prefill_is_computed_then_cached(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=120)
    kwargs = dict(model="claude", max_tokens=8, system=long_text(300, 32),
                  extra_body={"temperature": 0})
    before = bases(stack)
    with client.messages.stream(messages=[{"role": "user", "content": "Name a colour."}],
                                extra_headers={"x-claude-code-session-id": "base-first"},
                                **kwargs) as stream:
        starts = [e.message.usage for e in stream if e.type == "message_start"]
        first = stream.get_final_message().usage   # message_delta's figures
        assert stream.response.headers["X-KVProxy-Cache"] == "miss"
    base = new_base(stack, before)
    assert starts[0].cache_read_input_tokens == first.cache_read_input_tokens == \
        base["found_cached"]
    assert starts[0].input_tokens == first.input_tokens > base["n_tokens"] - base["found_cached"]

    raw = client.messages.with_raw_response.create(
        messages=[{"role": "user", "content": "Name a number."}],
        extra_headers={"x-claude-code-session-id": "base-later"}, **kwargs)
    later = raw.parse().usage
    assert raw.headers["X-KVProxy-Cache"] == "base"
    assert later.cache_read_input_tokens == base["n_tokens"] and 0 < later.input_tokens < 40
    print(f"\nanthropic: made the base {first}, behind it {later}")


def test_ollama_a_base_prefill_is_computed_then_cached(stack):
    client = ollama.Client(host=stack.url, timeout=120)
    name = client.list().models[0].model
    system = {"role": "system", "content": long_text(300, 33)}
    options = {"num_predict": 8, "temperature": 0}
    before = bases(stack)
    first = client.chat(model=name, options=options,
                        messages=[system, {"role": "user", "content": "Name a colour."}])
    base = new_base(stack, before)
    # the system prompt is counted as evaluated, and its time with it
    assert first.prompt_eval_count > base["n_tokens"] - base["found_cached"]
    parts = list(client.chat(model=name, options=options, stream=True,
                             messages=[system, {"role": "user", "content": "Name a number."}]))
    later = parts[-1]
    assert 0 < later.prompt_eval_count < 40
    assert first.prompt_eval_duration > 2 * later.prompt_eval_duration, \
        "the system prompt's prefill time is in the first prompt_eval_duration"
    print(f"\nollama: made the base prompt_eval_count={first.prompt_eval_count} "
          f"prompt_eval_duration={first.prompt_eval_duration / 1e6:.1f} ms; behind it "
          f"{later.prompt_eval_count}, {later.prompt_eval_duration / 1e6:.1f} ms")
