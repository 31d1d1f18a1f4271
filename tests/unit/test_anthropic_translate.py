"""Anthropic dialect without a model: translation both ways, then the routes with
llama-server stubbed by ``responses`` and driven by the real ``anthropic`` SDK."""
from __future__ import annotations

import json
import re

import anthropic
import httpx2
import pytest
import responses
from anthropic.lib.streaming._messages import accumulate_event

from kvproxy import create_app
from kvproxy.errors import ClientError
from kvproxy.translate import anthropic as t
from kvproxy.slots.switch import SlotBusy

UPSTREAM = "http://llama.test"
WEATHER_TOOL = {"name": "get_weather", "description": "Weather for a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}
TIMINGS = {"cache_n": 120, "prompt_n": 7, "predicted_n": 5}


def parse_sse(data: bytes) -> list[tuple[str, dict]]:
    """(event name, data) pairs; fails if an event lacks its ``event:`` line."""
    events = []
    for raw in data.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in raw.split("\n"))
        assert set(lines) == {"event", "data"}, raw
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    """One OpenAI chat chunk as llama-server streams it."""
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
            "object": "chat.completion.chunk", **extra}


def tool_delta(index: int, arguments: str = "", name: str | None = None) -> dict:
    call: dict = {"index": index, "function": {}}
    if name:
        call.update(id=f"call_{index}", type="function")
        call["function"]["name"] = name
    if arguments:
        call["function"]["arguments"] = arguments
    return {"tool_calls": [call]}


MIXED_STREAM = [
    chunk({"role": "assistant", "content": None}),
    chunk({"reasoning_content": "The user wants "}),
    chunk({"reasoning_content": "weather."}),
    chunk({"content": "Let me check."}),
    chunk(tool_delta(0, name="get_weather")),
    chunk(tool_delta(0, '{"ci')),
    chunk(tool_delta(0, 'ty": "Par')),
    chunk(tool_delta(0, 'is"}')),
    chunk(tool_delta(1, '{"city": "Rome', name="get_weather")),
    chunk(tool_delta(1, '"}')),
    chunk(tool_delta(2, name="get_time")),
    chunk({}, "tool_calls", timings=TIMINGS),
]


def translate_stream(chunks: list[dict], stops=()) -> list[tuple[str, dict]]:
    events = [(json.dumps(c).encode(), c) for c in chunks] + [(b"data: [DONE]", None)]
    return parse_sse(b"".join(t.stream_events(events, "claude-test", stops)))


# -- request translation ---------------------------------------------------
def request(**fields) -> dict:
    return {"model": "claude-test", "max_tokens": 16,
            "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_system_string_and_text_blocks_become_one_leading_system_message():
    as_string = t.to_llama(request(system="Be brief."))
    assert as_string["messages"][0] == {"role": "system", "content": "Be brief."}
    blocks = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
              {"type": "image", "source": {}}, {"type": "text", "text": "Be kind."}]
    as_blocks = t.to_llama(request(system=blocks))
    assert as_blocks["messages"][0] == {"role": "system", "content": "Be brief.\nBe kind."}
    assert as_blocks["messages"][1] == {"role": "user", "content": "Hi"}
    assert t.to_llama(request())["messages"][0]["role"] == "user"


def test_claude_code_billing_checksum_does_not_change_the_prompt():
    def system(cch: str) -> str:
        body = request(system=[{"type": "text", "text": f"x-anthropic-billing-header: "
                                f"cc_version=2.1.1; cc_entrypoint=cli; cch={cch};"},
                               {"type": "text", "text": "You are Claude Code."}])
        return t.to_llama(body)["messages"][0]["content"]
    assert system("a5145") == system("9be01")
    assert "You are Claude Code." in system("a5145") and "cc_version=2.1.1" in system("a5145")


def test_tool_use_round_trip_request():
    body = request(tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need a tool.", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "Sunny, 21 C"}]},
            {"type": "text", "text": "And tomorrow?"}]}])
    messages = t.to_llama(body)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assistant = messages[1]
    assert assistant["content"] == "Checking."
    assert assistant["reasoning_content"] == "Need a tool."
    call = assistant["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"}
    assert messages[3] == {"role": "user", "content": "And tomorrow?"}


def test_tool_result_error_and_string_content():
    body = request(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": "boom", "is_error": True},
        {"type": "tool_result", "tool_use_id": "b"}]}])
    messages = t.to_llama(body)["messages"]
    assert messages[0]["tool_call_id"] == "a" and "boom" in messages[0]["content"]
    assert messages[0]["content"].startswith("Error")
    assert messages[1] == {"role": "tool", "tool_call_id": "b", "content": ""}


def test_unknown_blocks_and_top_level_fields_are_skipped():
    body = request(cache_control={"type": "ephemeral"}, context_management={"edits": []},
                   metadata={"user_id": "u1"}, service_tier="auto", messages=[
                       {"role": "user", "content": [
                           {"type": "text", "text": "Hello", "cache_control": {}},
                           {"type": "search_result", "content": []},
                           {"type": "document", "source": {"type": "text", "data": "Doc body"}}]},
                       {"role": "assistant", "content": [
                           {"type": "redacted_thinking", "data": "x"},
                           {"type": "server_tool_use", "id": "s", "name": "web_search"},
                           {"type": "text", "text": "Hi!"}]},
                       {"role": "assistant", "content": [{"type": "redacted_thinking"}]}])
    out = t.to_llama(body)
    assert out["messages"] == [{"role": "user", "content": "Hello\nDoc body"},
                               {"role": "assistant", "content": "Hi!"}]
    for key in ("cache_control", "context_management", "metadata", "service_tier", "model"):
        assert key not in out


def test_image_block_becomes_a_data_uri_part():
    body = request(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                     "data": "QUJD"}},
        {"type": "text", "text": "What is this?"}]}])
    content = t.to_llama(body)["messages"][0]["content"]
    assert content == [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
                       {"type": "text", "text": "What is this?"}]


SCREENSHOT = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}


def test_images_reach_llama_server_as_its_own_anthropic_route_sends_them():
    """A coding agent's screenshot, returned by a tool, next to a user's own image."""
    body = request(tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "Screen:"}, SCREENSHOT]},
            {"type": "image", "source": {"type": "base64", "data": "QUJD"}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "text", "text": "What changed?"}]}])
    assert t.to_llama(body)["messages"][2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": [
            {"type": "text", "text": "Screen:"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},
        {"role": "user", "content": [
            # no media_type: llama-server's route assumes JPEG
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            {"type": "text", "text": "What changed?"}]}]


def test_an_image_only_tool_result_keeps_its_image_and_a_text_one_stays_a_string():
    body = request(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [SCREENSHOT]},
        {"type": "tool_result", "tool_use_id": "b",
         "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]}])
    assert t.to_llama(body)["messages"] == [
        {"role": "tool", "tool_call_id": "a", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},
        {"role": "tool", "tool_call_id": "b", "content": "one\ntwo"}]


@pytest.mark.parametrize("choice, expected, names", [
    (None, "auto", ["get_weather", "get_time"]),
    ({"type": "auto"}, "auto", ["get_weather", "get_time"]),
    ({"type": "any"}, "required", ["get_weather", "get_time"]),
    ({"type": "none"}, "none", ["get_weather", "get_time"]),
    ({"type": "tool", "name": "get_time"}, "required", ["get_time"]),
])
def test_tools_and_tool_choice(choice, expected, names):
    time_tool = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    fields = {"tools": [WEATHER_TOOL, time_tool, server_tool]}
    if choice:
        fields["tool_choice"] = choice
    out = t.to_llama(request(**fields))
    assert out["tool_choice"] == expected
    assert [f["function"]["name"] for f in out["tools"]] == names
    assert all(f["type"] == "function" for f in out["tools"])
    if "get_weather" in names:
        assert out["tools"][0]["function"]["parameters"] == WEATHER_TOOL["input_schema"]
        assert out["tools"][0]["function"]["description"] == "Weather for a city"


def test_parallel_tool_use_can_be_switched_off_and_no_tools_means_no_choice():
    out = t.to_llama(request(tools=[WEATHER_TOOL],
                             tool_choice={"type": "auto", "disable_parallel_tool_use": True}))
    assert out["parallel_tool_calls"] is False
    assert "tool_choice" not in t.to_llama(request(tool_choice={"type": "any"}))


def test_thinking_options():
    enabled = t.to_llama(request(thinking={"type": "enabled", "budget_tokens": 2048}))
    assert enabled["chat_template_kwargs"] == {"enable_thinking": True}
    assert enabled["thinking_budget_tokens"] == 2048
    disabled = t.to_llama(request(thinking={"type": "disabled"}))
    assert disabled["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in t.to_llama(request())


def test_sampling_fields_and_stop_sequences():
    out = t.to_llama(request(temperature=0.2, top_p=0.9, top_k=40, stop_sequences=["END"]))
    assert (out["max_tokens"], out["temperature"], out["top_p"], out["top_k"]) == (16, 0.2, 0.9, 40)
    assert out["stop"] == ["END"]
    assert out["verbose"] is True and "stopping_word" in out["response_fields"]
    plain = t.to_llama(request())
    assert "stop" not in plain and "verbose" not in plain


def test_structured_output_schema_becomes_a_response_format():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    out = t.to_llama(request(output_config={"format": {"type": "json_schema", "schema": schema},
                                            "effort": "low"}))
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"schema": schema}}
    assert "response_format" not in t.to_llama(request(output_config={"effort": "low"}))


@pytest.mark.parametrize("fields, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"temperature": "hot"}, "temperature"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
])
def test_invalid_requests_name_the_field(fields, field):
    body = {k: v for k, v in request(**fields).items() if v is not None}
    with pytest.raises(ClientError, match=field):
        t.to_llama(body)


def test_count_only_keeps_what_shapes_the_prompt():
    body = request(system="S", tools=[WEATHER_TOOL], stop_sequences=["x"], temperature=1)
    del body["max_tokens"]
    out = t.to_llama(body, count_only=True)
    assert set(out) == {"messages", "tools", "tool_choice"}
    assert out["messages"][0] == {"role": "system", "content": "S"}


# -- response translation --------------------------------------------------
def test_tool_call_result_becomes_tool_use_blocks():
    result = {"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
        "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}}],
        "usage": {"prompt_tokens": 127, "completion_tokens": 5}, "timings": TIMINGS}
    message = t.to_message(result, "claude-test")
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["model"] == "claude-test"
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][2] == {"type": "tool_use", "id": "call_9", "name": "get_weather",
                                     "input": {"city": "Paris"}}
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert message["usage"] == {"input_tokens": 7, "output_tokens": 5,
                                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 120}


def test_empty_answer_still_has_a_text_block_and_bad_arguments_are_kept():
    assert t.to_message({"choices": [{"finish_reason": "stop", "message": {}}]},
                        "m")["content"] == [{"type": "text", "text": ""}]
    assert t.tool_input("{not json") == {"_raw_arguments": "{not json"}
    assert t.tool_input("") == {}


@pytest.mark.parametrize("finish, verbose, tools, expected", [
    ("stop", None, False, ("end_turn", None)),
    ("stop", {"stop_type": "eos", "stopping_word": ""}, False, ("end_turn", None)),
    ("stop", {"stop_type": "word", "stopping_word": "END"}, False, ("stop_sequence", "END")),
    ("stop", {"stop_type": "word", "stopping_word": "<|im_end|>"}, False, ("end_turn", None)),
    ("length", {"stop_type": "limit"}, False, ("max_tokens", None)),
    ("tool_calls", None, True, ("tool_use", None)),
    ("stop", None, True, ("tool_use", None)),
    ("length", None, True, ("max_tokens", None)),
])
def test_stop_reason_mapping(finish, verbose, tools, expected):
    assert t.stop_reason(finish, verbose, ["END"], tools) == expected


def test_usage_without_timings_falls_back_to_openai_usage():
    figures = t.usage(None, {"prompt_tokens": 100, "completion_tokens": 3,
                             "prompt_tokens_details": {"cached_tokens": 90}})
    assert figures == {"input_tokens": 10, "output_tokens": 3,
                       "cache_creation_input_tokens": 0, "cache_read_input_tokens": 90}


# -- stream translation ----------------------------------------------------
def test_stream_event_order_and_block_indices():
    events = translate_stream(MIXED_STREAM)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d for n, d in events if n == "content_block_start"]
    assert [d["index"] for d in starts] == [0, 1, 2, 3, 4]
    assert [d["content_block"]["type"] for d in starts] == \
        ["thinking", "text", "tool_use", "tool_use", "tool_use"]
    assert starts[0]["content_block"]["thinking"] == "" and starts[1]["content_block"]["text"] == ""
    assert [d["content_block"]["name"] for d in starts[2:]] == ["get_weather", "get_weather",
                                                                "get_time"]
    assert len({d["content_block"]["id"] for d in starts[2:]}) == 3
    open_index = None
    for name, data in events:  # each block: start, its deltas, stop, before the next one
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5
    assert delta["usage"]["cache_read_input_tokens"] == 120
    assert delta["usage"]["input_tokens"] == 7


def test_stream_input_json_pieces_concatenate_to_valid_json():
    events = translate_stream(MIXED_STREAM)
    pieces: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
            pieces[data["index"]] = pieces.get(data["index"], "") + data["delta"]["partial_json"]
    assert {i: json.loads(p) for i, p in pieces.items()} == \
        {2: {"city": "Paris"}, 3: {"city": "Rome"}, 4: {}}


def test_stream_accumulates_into_the_sdk_message():
    snapshot, json_bufs = None, {}
    for _name, data in translate_stream(MIXED_STREAM):
        if data["type"] != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot.content[0].thinking == "The user wants weather."
    assert snapshot.content[1].text == "Let me check."
    assert snapshot.content[2].input == {"city": "Paris"}
    assert snapshot.stop_reason == "tool_use"
    assert snapshot.usage.cache_read_input_tokens == 120 and snapshot.usage.input_tokens == 7


def test_stream_of_plain_text_with_a_stop_sequence():
    events = translate_stream([
        chunk({"role": "assistant", "content": None}), chunk({"content": "Hello"}),
        chunk({"content": " world"}, __verbose={"stop_type": "word", "stopping_word": "END"}),
        chunk({}, "stop", timings=TIMINGS)], stops=["END"])
    deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert deltas == ["Hello", " world"]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_stream_with_no_content_still_has_one_text_block():
    events = translate_stream([chunk({}, "stop", timings=TIMINGS)])
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start",
                                      "content_block_stop", "message_delta", "message_stop"]


def test_stream_cut_before_the_finish_ends_with_an_error_event():
    events = translate_stream([chunk({"content": "Hel"})])
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "message_stop" not in [n for n, _ in events]


# -- errors -----------------------------------------------------------------
@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"),
    (503, "overloaded_error"), (529, "overloaded_error"), (504, "api_error")])
def test_error_shape_by_status(status, kind):
    assert t.error_body(status, "why") == {"type": "error",
                                           "error": {"type": kind, "message": "why"}}
    name, data = parse_sse(t.stream_error(status, "why"))[0]
    assert name == "error" and data == t.error_body(status, "why")


# -- routes, llama-server stubbed --------------------------------------------
@pytest.fixture
def upstream():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.get(f"{UPSTREAM}/props", json={"model_path": "/m/tiny.gguf", "build_info": "b1",
                                            "default_generation_settings": {"n_ctx": 8192}})
        mock.get(f"{UPSTREAM}/v1/models", json={"data": [{"id": "tiny.gguf", "created": 1,
                                                          "meta": {"size": 1}}]})
        mock.get(f"{UPSTREAM}/slots", json=[{"id": 0, "n_ctx": 8192}])
        mock.post(re.compile(f"{UPSTREAM}/slots/0.*"), json={"id_slot": 0, "n_saved": 0})
        yield mock


@pytest.fixture
def app(tmp_path):
    return create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM})


@pytest.fixture
def sdk(app):
    http = httpx2.Client(transport=httpx2.WSGITransport(app=app))
    yield anthropic.Anthropic(base_url="http://127.0.0.1", api_key="x", max_retries=0,
                              http_client=http)
    http.close()


def sent_body(mock: responses.RequestsMock) -> dict:
    calls = [c for c in mock.calls if c.request.url.endswith("/v1/chat/completions")]
    return json.loads(calls[-1].request.body)


def test_route_non_streamed_tool_call_through_the_sdk(upstream, sdk):
    upstream.post(f"{UPSTREAM}/v1/chat/completions", json={
        "choices": [{"finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]}}],
        "timings": TIMINGS})
    raw = sdk.messages.with_raw_response.create(
        model="claude-kvproxy-test", max_tokens=16, tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Oslo?"}], stop_sequences=["END"],
        extra_headers={"x-claude-code-session-id": "cc-session-1", "anthropic-beta": "x"},
        extra_body={"context_management": {"edits": []}})
    message = raw.parse()
    assert raw.headers["X-KVProxy-Session"] == "cc-session-1"
    assert message.model == "claude-kvproxy-test" and message.stop_reason == "tool_use"
    assert message.content[0].type == "tool_use" and message.content[0].input == {"city": "Oslo"}
    assert message.usage.cache_read_input_tokens == 120 and message.usage.input_tokens == 7
    body = sent_body(upstream)
    assert body["tool_choice"] == "required" and body["stream"] is False
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert body["stop"] == ["END"] and body["max_tokens"] == 16 and body["id_slot"] == 0
    assert "context_management" not in body


def test_route_streamed_tool_call_through_the_sdk(upstream, sdk):
    stream = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in MIXED_STREAM)
    upstream.post(f"{UPSTREAM}/v1/chat/completions", body=stream + b"data: [DONE]\n\n",
                  content_type="text/event-stream")
    with sdk.messages.stream(model="claude-x", max_tokens=16, tools=[WEATHER_TOOL],
                             messages=[{"role": "user", "content": "Weather?"}],
                             metadata={"user_id": "user-7"}) as events:
        text = "".join(events.text_stream)
        final = events.get_final_message()
    assert text == "Let me check."
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use",
                                               "tool_use"]
    assert [b.input for b in final.content[2:]] == [{"city": "Paris"}, {"city": "Rome"}, {}]
    assert final.usage.cache_read_input_tokens == 120 and final.usage.output_tokens == 5
    assert sent_body(upstream)["stream"] is True


def test_route_error_inside_the_stream_becomes_an_error_event(upstream, app):
    stream = (b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
              b'data: {"error":{"code":500,"message":"decode failed"}}\n\n')
    upstream.post(f"{UPSTREAM}/v1/chat/completions", body=stream, content_type="text/event-stream")
    reply = app.test_client().post("/v1/messages", json=request(stream=True))
    events = parse_sse(reply.data)
    assert reply.status_code == 200 and events[0][0] == "message_start"
    assert events[-1] == ("error", t.error_body(500, "llama-server: decode failed"))


def test_route_errors_have_anthropic_shape(upstream, app, sdk):
    client = app.test_client()
    bad_json = client.post("/v1/messages", data=b"{nope", content_type="application/json")
    assert bad_json.status_code == 400
    assert bad_json.get_json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as missing:
        sdk.post("/v1/messages", cast_to=httpx2.Response,
                 body={"model": "m", "max_tokens": 0,
                       "messages": [{"role": "user", "content": "x"}]})
    assert "max_tokens" in missing.value.body["error"]["message"]
    upstream.post(f"{UPSTREAM}/v1/chat/completions", status=400,
                  json={"error": {"code": 400, "message": "context too long"}})
    too_long = client.post("/v1/messages", json=request())
    assert too_long.status_code == 400
    assert too_long.get_json() == t.error_body(400, "llama-server: context too long")


def test_route_unreachable_and_busy_upstream(upstream, app, monkeypatch):
    client = app.test_client()
    unreachable = client.post("/v1/messages", json=request())  # no stub: connection refused
    assert unreachable.status_code == 503 and unreachable.headers["Retry-After"] == "5"
    assert unreachable.get_json()["error"]["type"] == "overloaded_error"

    def busy(call):
        raise SlotBusy(5, retry_after=3)
    monkeypatch.setattr(app.extensions["kvproxy.relay"], "complete", busy)
    reply = client.post("/messages?beta=true", json=request())
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "3"
    assert reply.get_json()["error"]["type"] == "overloaded_error"


def test_route_count_tokens_and_models_through_the_sdk(upstream, sdk):
    upstream.post(f"{UPSTREAM}/apply-template", json={"prompt": "<s>templated</s>"})
    upstream.post(f"{UPSTREAM}/tokenize", json={"tokens": [1, 2, 3, 4, 5, 6]})
    counted = sdk.messages.count_tokens(model="claude-x", system="S", tools=[WEATHER_TOOL],
                                        messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens == 6
    template_calls = [c for c in upstream.calls if c.request.url.endswith("/apply-template")]
    sent = json.loads(template_calls[-1].request.body)
    assert sent["messages"][0] == {"role": "system", "content": "S"}
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    models = list(sdk.models.list())
    assert [m.id for m in models] == ["tiny"]
    assert models[0].type == "model" and models[0].display_name == "tiny"
    assert models[0].created_at.year == 1970
