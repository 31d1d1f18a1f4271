"""The Anthropic route takes what Claude Code 2.1 sends, as llama-server's own /v1/messages does.

Recorded requests (tests/fixtures/recorded/claude-code/) go through the translation and
through the route with llama-server stubbed; message_start carries the prompt figures.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import responses

from kvproxy import create_app
from kvproxy.translate import anthropic as t
from recorder import load_fixtures

UPSTREAM = "http://llama.test"
RECORDED = Path(__file__).parents[1] / "fixtures" / "recorded"
CLAUDE_CODE = load_fixtures(RECORDED / "claude-code")


def request(**fields) -> dict:
    return {"model": "claude-test", "max_tokens": 16,
            "messages": [{"role": "user", "content": "Hi"}], **fields}


def roles(body: dict) -> list[str]:
    return [m["role"] for m in t.to_llama(body)["messages"]]


def test_system_messages_anywhere_stay_where_they_stand():
    body = request(system="Top.", messages=[
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Environment: linux"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "system", "content": [{"type": "text", "text": "Note A",
                                        "cache_control": {"type": "ephemeral"}},
                                       {"type": "text", "text": "Note B"}]},
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [], "output_config": {"effort": "medium"}},
        {"role": "user", "content": "More"}])
    messages = t.to_llama(body)["messages"]
    assert messages == [{"role": "system", "content": "Top."},
                        {"role": "user", "content": "Hi"},
                        {"role": "system", "content": "Environment: linux"},
                        {"role": "assistant", "content": "Hello"},
                        {"role": "system", "content": "Note A\nNote B"},
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "More"}]


def test_string_and_block_forms_of_one_system_message_translate_alike():
    """Claude Code sends its environment message as blocks, then as a string on resume."""
    as_blocks = request(messages=[{"role": "user", "content": "Hi"}, {"role": "system", "content": [
        {"type": "text", "text": "Env"}]}])
    as_string = request(messages=[{"role": "user", "content": "Hi"},
                                  {"role": "system", "content": "Env"}])
    assert t.to_llama(as_blocks) == t.to_llama(as_string)


def test_fields_claude_code_sends_are_ignored_or_mapped():
    body = request(thinking={"type": "adaptive", "display": "omitted"},
                   context_management={"edits": [{"type": "clear_thinking_20251015",
                                                  "keep": "all"}]},
                   output_config={"effort": "medium"}, metadata={"user_id": "{}"},
                   cache_control={"type": "ephemeral"})
    out = t.to_llama(body)
    # adaptive: the model decides, so the server's own reasoning setting stays.
    assert "chat_template_kwargs" not in out and "thinking_budget_tokens" not in out
    assert out["reasoning_effort"] == "medium"
    for field in ("thinking", "context_management", "output_config", "metadata",
                  "cache_control", "model"):
        assert field not in out


@pytest.mark.parametrize("effort, expected", [("low", "low"), ("high", "high"),
                                               ("max", "high"), ("xhigh", "high"),
                                               ("turbo", None), (3, None)])
def test_effort_becomes_reasoning_effort(effort, expected):
    out = t.to_llama(request(output_config={"effort": effort}))
    assert out.get("reasoning_effort") == expected
    counted = t.to_llama(request(output_config={"effort": effort}), count_only=True)
    assert counted.get("reasoning_effort") == expected


def test_thinking_budget_still_reaches_llama_server():
    out = t.to_llama(request(thinking={"type": "enabled", "budget_tokens": 1024}))
    assert out["chat_template_kwargs"] == {"enable_thinking": True}
    assert out["thinking_budget_tokens"] == 1024


def test_missing_model_and_max_tokens_are_answered_as_llama_server_does():
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": None}
    out = t.to_llama(body)
    assert out["max_tokens"] == t.DEFAULT_MAX_TOKENS == 4096
    del body["max_tokens"]
    assert t.to_llama(body)["max_tokens"] == 4096


def test_system_of_another_shape_is_skipped():
    assert roles(request(system=5)) == ["user"]
    assert roles(request(system={"text": "x"})) == ["user"]


@pytest.mark.parametrize("record", CLAUDE_CODE, ids=lambda r: str(len(r["body"]["messages"])))
def test_recorded_claude_code_requests_translate(record):
    body = record["body"]
    assert any(m["role"] == "system" for m in body["messages"])  # what broke kvproxy
    out = t.to_llama(body)
    sent_roles = [m["role"] for m in body["messages"]]
    assert [m["role"] for m in out["messages"]][0] == "system"
    assert sum(r == "system" for r in (m["role"] for m in out["messages"])) >= 2
    assert "user" in sent_roles and out["max_tokens"] == body["max_tokens"]
    assert {f["function"]["name"] for f in out.get("tools", [])} == \
        {tool["name"] for tool in body.get("tools", []) if "input_schema" in tool}


# -- stream usage -----------------------------------------------------------
def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
            "object": "chat.completion.chunk", **extra}


def events_of(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for raw in data.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in raw.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_message_start_carries_the_first_chunks_prompt_figures():
    first = {"cache_n": 1200, "prompt_n": 34, "predicted_n": 1}
    last = {"cache_n": 1200, "prompt_n": 34, "predicted_n": 3}
    # as llama-server sends them: a bare role delta, then the first token with its timings
    chunks = [chunk({"role": "assistant", "content": None}),
              chunk({"content": "Hi"}, timings=first),
              chunk({"content": "!"}, timings={**first, "predicted_n": 2}),
              chunk({}, "stop", timings=last)]
    events = events_of(b"".join(t.stream_events(
        [(b"", c) for c in chunks] + [(b"", None)], "claude-test")))
    assert events[0][0] == "message_start"
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 34, "output_tokens": 0, "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 1200}
    assert events[-2][1]["usage"]["output_tokens"] == 3
    assert events[-2][1]["usage"]["cache_read_input_tokens"] == 1200


def test_an_empty_stream_still_starts_with_message_start():
    events = events_of(b"".join(t.stream_events([(b"", None)], "m")))
    assert [name for name, _ in events] == ["message_start", "ping", "error"]


# -- the route, llama-server stubbed -----------------------------------------
@pytest.fixture
def app(tmp_path):
    return create_app({"upstream": UPSTREAM, "slot_dir": str(tmp_path)})


def stub_llama(mock: responses.RequestsMock, chunks: list[dict]) -> list[dict]:
    """Slot calls succeed; chat answers ``chunks`` as SSE. Returns the chat bodies sent."""
    sent: list[dict] = []

    def chat(req):
        body = json.loads(req.body)
        sent.append(body)
        if not body.get("stream"):
            return 200, {}, json.dumps({"choices": [{"finish_reason": "stop", "message": {
                "role": "assistant", "content": "Hi"}}], "timings": chunks[-1].get("timings")})
        data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return 200, {"Content-Type": "text/event-stream"}, data

    mock.add_callback(responses.POST, f"{UPSTREAM}/v1/chat/completions", callback=chat)
    mock.add(responses.GET, f"{UPSTREAM}/slots", json=[{"id": 0, "is_processing": False}])
    mock.add(responses.GET, f"{UPSTREAM}/props", json={"model_path": "/m/tiny.gguf",
                                                       "build_info": "b1",
                                                       "default_generation_settings": {
                                                           "n_ctx": 8192}})
    mock.add(responses.GET, f"{UPSTREAM}/v1/models",
             json={"data": [{"id": "tiny.gguf", "meta": {"size": 1, "n_params": 1}}]})
    mock.add(responses.POST, re.compile(rf"{UPSTREAM}/slots/0\?action=\w+"),
             json={"n_saved": 0, "n_restored": 0, "n_erased": 0})
    return sent


@pytest.mark.parametrize("record", CLAUDE_CODE, ids=lambda r: str(len(r["body"]["messages"])))
def test_recorded_claude_code_request_is_answered(app, record):
    timings = {"cache_n": 0, "prompt_n": 812, "predicted_n": 1}
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        sent = stub_llama(mock, [chunk({"role": "assistant", "content": None}),
                                 chunk({"content": "Hello"}, timings=timings),
                                 chunk({}, "stop", timings={**timings, "predicted_n": 2})])
        reply = app.test_client().post(record["path"], json=record["body"],
                                       headers=record["headers"])
    assert reply.status_code == 200, reply.data
    events = events_of(reply.data)
    assert [name for name, _ in events][:2] == ["message_start", "ping"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 812
    assert events[-1][0] == "message_stop"
    assert sent[0]["timings_per_token"] is True and sent[0]["stream"] is True
    assert reply.headers["X-KVProxy-Session"] == record["headers"]["x-claude-code-session-id"]


def test_whole_answers_do_not_ask_for_per_token_timings(app):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        sent = stub_llama(mock, [chunk({}, "stop", timings={"prompt_n": 5, "cache_n": 0})])
        body = request()
        del body["model"]
        reply = app.test_client().post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.data
    assert reply.get_json()["model"] == "tiny"  # no model named: the served one
    assert "timings_per_token" not in sent[0]


def test_claude_code_request_variants_are_answered(app):
    """Unknown block types, betas and fields of a later Claude Code do not break the route."""
    body = copy.deepcopy(CLAUDE_CODE[-1]["body"])
    body["messages"].insert(1, {"role": "system", "content": [{"type": "future_block", "x": 1}]})
    body["messages"][-1]["content"].append({"type": "container_upload", "file_id": "f"})
    body["brand_new_field"] = {"anything": True}
    headers = {**CLAUDE_CODE[-1]["headers"], "anthropic-beta": "some-future-beta-2099-01-01"}
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        stub_llama(mock, [chunk({}, "stop", timings={"prompt_n": 5, "cache_n": 0})])
        reply = app.test_client().post("/v1/messages?beta=true", json=body, headers=headers)
    assert reply.status_code == 200, reply.data


def test_a_screenshot_in_a_tool_result_reaches_llama_server_as_an_image_part(app):
    """What a vision model reads: the tool message carries the image as llama-server's own
    /v1/messages would send it."""
    screenshot = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": "iVBORw0KGgo="}}
    body = request(messages=[
        {"role": "user", "content": "What is on my screen?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [screenshot]}]}])
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        sent = stub_llama(mock, [chunk({}, "stop", timings={"prompt_n": 5, "cache_n": 0})])
        reply = app.test_client().post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.data
    assert sent[0]["messages"][-1] == {"role": "tool", "tool_call_id": "toolu_1", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}
