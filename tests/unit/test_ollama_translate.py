"""Ollama dialect without a real llama-server: pure translation, then routes on a stub.

The route tests stub llama-server with ``responses`` and replace the slot switch
with a recorder, so they check the dialect alone: what it sends upstream and
what an Ollama client reads back.
"""
from __future__ import annotations

import base64
import io
import json
import struct
from datetime import datetime

import pytest
import responses

from kvproxy import create_app
from kvproxy.errors import ClientError
from kvproxy.upstream import gguf
from kvproxy.translate import ollama_model
from kvproxy.translate import ollama as tr
from kvproxy.upstream.llama import UpstreamError
from kvproxy.slots.lease import Lease
from kvproxy.slots.switch import SlotBusy

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(24)).decode()


# -- options, format, think ---------------------------------------------------
def test_options_map_to_llama_fields_and_unknown_ones_are_ignored():
    body = tr.translate_options({
        "temperature": 0.2, "top_p": 0.9, "top_k": 40.0, "min_p": 0.05, "num_predict": 12,
        "stop": "###", "seed": 7, "repeat_penalty": 1.1, "repeat_last_n": 64,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "num_ctx": 4096, "num_gpu": 99,
        "made_up": "whatever"})
    assert body == {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                    "max_tokens": 12, "stop": ["###"], "seed": 7, "repeat_penalty": 1.1,
                    "repeat_last_n": 64, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    assert isinstance(body["top_k"], int)


@pytest.mark.parametrize("num_predict", [-1, -2])
def test_unbounded_num_predict_leaves_llama_default(num_predict):
    assert "max_tokens" not in tr.translate_options({"num_predict": num_predict})


@pytest.mark.parametrize("options", [{"temperature": "hot"}, {"top_k": 1.5}, {"seed": True},
                                     {"stop": 3}, "not an object"])
def test_badly_typed_options_are_a_400(options):
    with pytest.raises(ClientError) as info:
        tr.translate_options(options)
    assert info.value.status == 400


def test_format_json_and_schema():
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    assert tr.translate_format("json") == {"type": "json_object"}
    assert tr.translate_format(schema)["json_schema"]["schema"] == schema
    assert tr.translate_format(None) is None and tr.translate_format("") is None
    with pytest.raises(ClientError):
        tr.translate_format("yaml")


def test_think_switches_the_template_and_levels_set_the_effort():
    assert tr.translate_think(None) == {}
    assert tr.translate_think(False)["chat_template_kwargs"] == {"enable_thinking": False}
    on = tr.translate_think(True)
    assert on["chat_template_kwargs"] == {"enable_thinking": True}
    assert on["reasoning_format"] == "deepseek" and "reasoning_effort" not in on
    assert tr.translate_think("high")["reasoning_effort"] == "high"
    with pytest.raises(ClientError):
        tr.translate_think("maximum")


# -- messages, tools, images --------------------------------------------------
def test_chat_body_carries_tools_tool_calls_and_thinking_to_openai_shape():
    req = {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "thinking": "call the tool",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        "format": "json", "options": {"num_predict": 8}, "think": True}
    body = tr.chat_body(req, vision=False)
    assistant, tool = body["messages"][1], body["messages"][2]
    call = assistant["tool_calls"][0]
    assert call["type"] == "function" and call["id"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert assistant["reasoning_content"] == "call the tool"
    assert tool == {"role": "tool", "content": "sunny", "name": "get_weather"}
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert body["response_format"] == {"type": "json_object"} and body["max_tokens"] == 8
    assert body["chat_template_kwargs"]["enable_thinking"] is True


def test_images_need_a_vision_model():
    messages = [{"role": "user", "content": "what is this?", "images": [PNG]}]
    with pytest.raises(ClientError) as info:
        tr.translate_messages(messages, vision=False)
    assert info.value.status == 400 and "vision" in info.value.message
    content = tr.translate_messages(messages, vision=True)[0]["content"]
    assert content[0] == {"type": "text", "text": "what is this?"}
    assert content[1]["image_url"]["url"] == f"data:image/png;base64,{PNG}"
    with pytest.raises(ClientError):
        tr.translate_messages([{"role": "user", "content": "", "images": ["***"]}], vision=True)


def test_generate_templated_raw_and_refused_forms():
    path, body = tr.generate_call({"prompt": "hi", "system": "be brief",
                                   "options": {"num_predict": 4}}, vision=False)
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi"}]
    path, body = tr.generate_call({"prompt": "<s>raw", "raw": True, "format": "json"}, False)
    assert path == "/v1/completions" and body["prompt"] == "<s>raw"
    assert body["json_schema"] == {"type": "object"} and "messages" not in body
    for bad in ({"prompt": "x", "suffix": "y"}, {"prompt": "x", "raw": True, "images": [PNG]}):
        with pytest.raises(ClientError):
            tr.generate_call(bad, vision=True)


# -- answers --------------------------------------------------------------------
TIMINGS = {"cache_n": 90, "prompt_n": 10, "prompt_ms": 12.5, "predicted_n": 4,
           "predicted_ms": 40.0}


def test_durations_are_integer_nanoseconds_from_timings():
    fields = tr.durations(TIMINGS, {}, started_ns=0, now_ns=100_000_000)
    assert fields == {"total_duration": 100_000_000, "load_duration": 47_500_000,
                      "prompt_eval_count": 10, "prompt_eval_duration": 12_500_000,
                      "eval_count": 4, "eval_duration": 40_000_000}
    assert all(isinstance(v, int) for v in fields.values())
    # the wall clock never reports less than the evaluation itself
    assert tr.durations(TIMINGS, {}, 0, 1)["total_duration"] == 52_500_000


def test_durations_fall_back_to_usage_without_timings():
    usage = {"prompt_tokens": 100, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 96}}
    fields = tr.durations({}, usage, 0, 5)
    assert fields["prompt_eval_count"] == 4 and fields["eval_count"] == 3


@pytest.mark.parametrize("finish,expected", [("length", "length"), ("stop", "stop"),
                                             ("tool_calls", "stop"), (None, "stop")])
def test_done_reason(finish, expected):
    assert tr.done_reason(finish) == expected


def test_full_chat_reply_parses_tool_arguments_and_thinking():
    result = {"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning_content": "need weather",
        "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}}],
        "timings": TIMINGS}
    reply = tr.full_reply("chat", result, "m:latest", 0, 10**9)
    message = reply["message"]
    assert message["role"] == "assistant" and message["content"] == ""
    assert message["thinking"] == "need weather"
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert reply["done"] is True and reply["done_reason"] == "stop"
    assert reply["prompt_eval_count"] == 10
    hidden = tr.full_reply("chat", result, "m", 0, 1, keep_thinking=False)
    assert "thinking" not in hidden["message"]


def test_unparsable_tool_arguments_stay_visible_as_an_object():
    assert tr.tool_arguments("{not json") == {"raw": "{not json"}
    assert tr.tool_arguments("") == {} and tr.tool_arguments("[1]") == {"value": [1]}


def chunk(delta=None, finish=None, timings=None, text=None):
    choice = {"index": 0, "finish_reason": finish}
    if text is None:
        choice["delta"] = delta or {}
    else:
        choice["text"] = text
    event = {"choices": [choice]}
    if timings:
        event["timings"] = timings
    return b"", event


def stream(events, kind="chat", **kw):
    return list(tr.stream_objects(events, kind=kind, model="m:latest", started_ns=0,
                                  clock=lambda: 10**9, **kw))


def test_chat_stream_gathers_tool_call_fragments_and_ends_with_done():
    events = [chunk({"role": "assistant", "content": None}),
              chunk({"reasoning_content": "hmm"}), chunk({"content": "Hi"}),
              chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {
                  "name": "get_weather", "arguments": "{\"ci"}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "ty\": \"Oslo\"}"}}]}),
              chunk(finish="tool_calls", timings=TIMINGS), (b"", None)]
    objects = stream(events)
    assert all(o["message"]["role"] == "assistant" for o in objects)
    assert [o["message"].get("thinking") for o in objects[:1]] == ["hmm"]
    assert objects[1]["message"]["content"] == "Hi"
    calls = objects[2]["message"]["tool_calls"]
    assert calls[0]["function"] == {"index": 0, "name": "get_weather",
                                    "arguments": {"city": "Oslo"}}
    final = objects[-1]
    assert final["done"] is True and final["done_reason"] == "stop"
    assert [o["done"] for o in objects] == [False, False, False, True]
    assert final["eval_count"] == 4 and final["total_duration"] == 10**9


def test_generate_stream_from_text_completion_chunks():
    objects = stream([chunk(text=" a"), chunk(text=" b", finish="length", timings=TIMINGS),
                      (b"", None)], kind="generate")
    assert [o["response"] for o in objects] == [" a", " b", ""]
    assert objects[-1]["done_reason"] == "length" and objects[-1]["context"] == []


def test_thinking_is_dropped_when_think_was_false():
    objects = stream([chunk({"reasoning_content": "x"}), chunk({"content": "y"}, "stop"),
                      (b"", None)], keep_thinking=False)
    assert all("thinking" not in o["message"] for o in objects)


def test_a_stream_cut_before_it_finished_is_an_upstream_error():
    with pytest.raises(UpstreamError):
        stream([chunk({"content": "partial"})])


@pytest.mark.parametrize("keep_alive,reason", [(None, "load"), ("5m", "load"), (-1, "load"),
                                               (0, "unload"), ("0", "unload"), ("0s", "unload"),
                                               ("0m", "unload")])
def test_load_and_unload(keep_alive, reason):
    chat = tr.load_reply("chat", "m", keep_alive)
    assert chat["done_reason"] == reason and chat["message"]["role"] == "assistant"
    assert tr.load_reply("generate", "m", keep_alive)["response"] == ""


# -- model description ----------------------------------------------------------
def gguf_bytes(pairs, truncate=0):
    """A GGUF v3 header with the given (key, type, value) pairs and no tensors."""
    def string(text):
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs))
    for key, kind, value in pairs:
        out += string(key) + struct.pack("<I", kind)
        if kind == 8:
            out += string(value)
        elif kind == 9:  # array of strings
            out += struct.pack("<IQ", 8, len(value)) + b"".join(string(v) for v in value)
        else:
            out += struct.pack({4: "<I", 6: "<f", 7: "<?"}[kind], value)
    return out[:len(out) - truncate] if truncate else out


def test_gguf_header_gives_architecture_and_skips_arrays():
    data = gguf_bytes([("general.architecture", 8, "qwen3"), ("qwen3.context_length", 4, 40960),
                       ("tokenizer.ggml.tokens", 9, ["a", "b"]), ("general.file_type", 4, 15),
                       ("qwen3.rope.freq_base", 6, 1e6)])
    meta = gguf.read_gguf_metadata(io.BytesIO(data))
    assert meta["general.architecture"] == "qwen3" and meta["qwen3.context_length"] == 40960
    assert meta["general.file_type"] == 15 and "tokenizer.ggml.tokens" not in meta
    cut = gguf.read_gguf_metadata(io.BytesIO(gguf_bytes([("general.architecture", 8, "gemma3"),
                                                           ("x", 4, 1)], truncate=2)))
    assert cut == {"general.architecture": "gemma3"}
    assert gguf.read_gguf_metadata(io.BytesIO(b"not a gguf file")) == {}


@pytest.mark.parametrize("ftype,expected", [("Q4_1", "Q4_1"), ("Q4_K - Medium", "Q4_K_M"),
                                            ("(guessed) F16", "F16"), ("all F32", "F32"),
                                            ("IQ2_XXS - 2.0625 bpw", "IQ2_XXS")])
def test_quantization_in_ollama_spelling(ftype, expected):
    assert ollama_model.quantization(ftype, "model.gguf") == expected


def test_quantization_and_architecture_from_the_name_when_llama_server_is_silent():
    assert ollama_model.quantization(None, "/m/Qwen2.5-7B-Instruct-q5_k_m.gguf") == "Q5_K_M"
    assert ollama_model.guess_architecture("Qwen2.5-7B-Instruct") == "qwen2"
    assert ollama_model.guess_architecture("mystery") == "unknown"
    assert ollama_model.parameter_size(134_515_008) == "134.52M"
    assert ollama_model.parameter_size(8_030_261_248) == "8.0B"


def test_capabilities_follow_template_caps_and_modalities():
    plain = {"chat_template": "{{ messages }}", "chat_template_caps": {"supports_tools": False}}
    assert ollama_model.capabilities(plain) == ["completion"]
    rich = {"chat_template": "{% if enable_thinking %}<think>{% endif %}",
            "chat_template_caps": {"supports_tools": True}, "modalities": {"vision": True}}
    assert ollama_model.capabilities(rich) == ["completion", "tools", "vision", "thinking"]


def test_context_length_is_what_llama_server_serves():
    props = {"default_generation_settings": {"n_ctx": 4096}}
    assert ollama_model.context_length(props, {"n_ctx_train": 32768}) == 4096
    assert ollama_model.context_length({}, {"n_ctx": 65536, "n_ctx_train": 32768}) == 32768


# -- routes on a stubbed llama-server ---------------------------------------------
UPSTREAM = "http://llama.test"
MODEL_PATH = "/nonexistent/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"
PROPS = {"model_path": MODEL_PATH, "model_ftype": "Q4_K - Medium",
         "default_generation_settings": {"n_ctx": 4096}, "modalities": {"vision": False},
         "chat_template": "{{ x }}", "chat_template_caps": {"supports_tools": True}}
MODELS = {"data": [{"id": MODEL_PATH, "created": 1700000000, "meta": {
    "n_params": 494_032_768, "size": 397_000_000, "n_ctx_train": 32768, "n_embd": 896}}]}
NAME = "Qwen2.5-0.5B-Instruct-Q4_K_M"


def sse(*events):
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
                    for e in events)


@pytest.fixture
def upstream():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.add(responses.GET, f"{UPSTREAM}/props", json=PROPS)
        mock.add(responses.GET, f"{UPSTREAM}/v1/models", json=MODELS)
        yield mock


@pytest.fixture
def app(tmp_path, upstream):
    """The app with the slot switch replaced by a recorder of leases taken and given back.

    Afterwards every lease a route took must have been given back: a stream that
    kept its lease would block every later request.
    """
    application = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM})
    switch = application.extensions["kvproxy.switch"]
    switch.sessions, taken, switch.released = [], [], {}

    def acquire(session, **_):
        switch.sessions.append(session)
        taken.append(Lease(session, "miss"))
        return taken[-1]

    switch.acquire = acquire
    switch.swap_held = lambda slot, session, placed: acquire(session)   # side tasks
    switch.release = lambda lease, timings=None: switch.released.setdefault(id(lease), timings)
    yield application
    kept = [lease.session.id for lease in taken if id(lease) not in switch.released]
    assert not kept, f"leases never given back: {kept}"


@pytest.fixture
def client(app):
    return app.test_client()


def sent_bodies(mock, path):
    return [json.loads(call.request.body) for call in mock.calls if call.request.url.endswith(path)]


def test_root_version_tags_show_ps(client):
    assert client.get("/").get_data(as_text=True) == "Ollama is running"
    assert client.head("/").status_code == 200
    assert [int(p) for p in client.get("/api/version").json["version"].split(".")] == [0, 12, 3]
    entry = client.get("/api/tags").json["models"][0]
    assert entry["name"] == entry["model"] == f"{NAME}:latest"
    assert entry["size"] == 397_000_000 and len(entry["digest"]) == 64
    assert entry["details"]["family"] == "qwen2"
    assert entry["details"]["quantization_level"] == "Q4_K_M"
    datetime.fromisoformat(entry["modified_at"].replace("Z", "+00:00"))
    for body in ({"model": NAME}, {"model": f"{NAME}:latest"}, {"name": NAME.lower()}):
        show = client.post("/api/show", json=body).json
        assert show["model_info"]["general.architecture"] == "qwen2"
        assert show["model_info"]["qwen2.context_length"] == 4096
        assert show["capabilities"] == ["completion", "tools"]
    ps = client.get("/api/ps").json["models"][0]
    assert ps["context_length"] == 4096
    datetime.fromisoformat(ps["expires_at"].replace("Z", "+00:00"))


def test_unknown_model_is_404_everywhere(client):
    for path, body in (("/api/show", {"model": "llama3"}), ("/api/chat", {"model": "llama3"}),
                       ("/api/generate", {"model": "llama3", "prompt": "x"}),
                       ("/api/pull", {"model": "llama3"})):
        response = client.post(path, json=body)
        assert response.status_code == 404, path
        assert response.json["error"].startswith("model 'llama3' not found")


def test_chat_streams_ndjson_and_sends_options_upstream(client, app, upstream):
    upstream.add(responses.POST, f"{UPSTREAM}/v1/chat/completions", body=sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "timings": TIMINGS},
        b"[DONE]"))
    response = client.post("/api/chat", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}],
        "options": {"num_predict": 2, "temperature": 0, "bogus": 1}})
    assert response.status_code == 200 and response.mimetype == "application/x-ndjson"
    lines = response.get_data(as_text=True).split("\n")
    assert lines[-1] == "" and all(lines[:-1])
    objects = [json.loads(line) for line in lines[:-1]]
    assert "".join(o["message"]["content"] for o in objects) == "Hello"
    assert all(o["message"]["role"] == "assistant" for o in objects)
    assert objects[-1]["done"] and objects[-1]["prompt_eval_count"] == 10
    # the timings of the last chunk are handed back with the lease
    assert list(app.extensions["kvproxy.switch"].released.values()) == [TIMINGS]
    sent = sent_bodies(upstream, "/v1/chat/completions")[0]
    assert sent["stream"] is True and sent["max_tokens"] == 2 and sent["temperature"] == 0
    assert "bogus" not in sent


def test_chat_whole_and_task_requests_are_side_requests(client, app, upstream):
    upstream.add(responses.POST, f"{UPSTREAM}/v1/chat/completions", json={
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Title"}}], "timings": TIMINGS})
    response = client.post("/api/chat", headers={"X-OpenWebUI-Chat-Id": "chat-1"}, json={
        "model": f"{NAME}:latest", "stream": False,
        "messages": [{"role": "user", "content": "### Task:\nGenerate a title"}]})
    assert response.mimetype == "application/json"
    assert response.json["message"]["content"] == "Title" and response.json["done"] is True
    assert sent_bodies(upstream, "/v1/chat/completions")[0]["stream"] is False
    assert app.extensions["kvproxy.switch"].sessions[-1].id == "side"


def test_empty_chat_and_generate_load_without_touching_the_slot(client, app, upstream):
    assert client.post("/api/chat", json={"model": NAME, "messages": []}).json[
        "done_reason"] == "load"
    assert client.post("/api/generate", json={"model": NAME, "keep_alive": 0}).json[
        "done_reason"] == "unload"
    assert app.extensions["kvproxy.switch"].sessions == []
    assert not sent_bodies(upstream, "/v1/chat/completions")


def test_images_without_vision_are_refused_before_llama_server(client, upstream):
    response = client.post("/api/generate", json={"model": NAME, "prompt": "what?",
                                                  "images": [PNG]})
    assert response.status_code == 400 and "vision" in response.json["error"]
    assert not sent_bodies(upstream, "/v1/chat/completions")


def test_errors_have_ollama_shape_and_status(client, app, upstream):
    bad = client.post("/api/chat", data="{nope", content_type="application/json")
    assert bad.status_code == 400 and "JSON" in bad.json["error"]
    bad = client.post("/api/chat", json={"model": NAME, "messages": [{"content": "x"}]})
    assert bad.status_code == 400
    bad = client.post("/api/chat", json={"model": NAME, "stream": "yes",
                                         "messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 400

    def busy(session, **_):
        raise SlotBusy(5.0, retry_after=7)
    app.extensions["kvproxy.switch"].acquire = busy
    response = client.post("/api/chat", json={"model": NAME,
                                              "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 503 and response.headers["Retry-After"] == "7"
    assert "busy" in response.json["error"]


def test_llama_server_unreachable_is_503(tmp_path):
    with responses.RequestsMock():  # nothing registered: every request fails to connect
        client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM}).test_client()
        response = client.get("/api/tags")
    assert response.status_code == 503 and "llama-server" in response.json["error"]
    assert response.headers["Retry-After"] == "5"


def test_failure_after_the_stream_began_is_one_error_line(client, upstream):
    upstream.add(responses.POST, f"{UPSTREAM}/v1/chat/completions", body=sse(
        {"choices": [{"index": 0, "delta": {"content": "par"}}]},
        {"error": {"code": 500, "message": "decode failed"}}))
    response = client.post("/api/chat", json={"model": NAME,
                                              "messages": [{"role": "user", "content": "x"}]})
    lines = response.get_data(as_text=True).splitlines()
    assert response.status_code == 200
    assert json.loads(lines[0])["message"]["content"] == "par"
    assert json.loads(lines[-1]) == {"error": "llama-server: decode failed"}


def test_embed_reshapes_and_explains_a_missing_embeddings_flag(client, upstream):
    upstream.add(responses.POST, f"{UPSTREAM}/v1/embeddings", json={
        "data": [{"index": 1, "embedding": [0.0, 3.0, 4.0]},
                 {"index": 0, "embedding": [1.0, 0, 0]}],
        "usage": {"prompt_tokens": 5}})
    reply = client.post("/api/embed", json={"model": NAME, "input": ["a", "b"]}).json
    assert reply["embeddings"] == [[1.0, 0, 0], [0.0, 3.0, 4.0]]
    assert reply["prompt_eval_count"] == 5
    short = client.post("/api/embed", json={"model": NAME, "input": "b", "dimensions": 2}).json
    assert short["embeddings"][1] == [0.0, 1.0]
    upstream.replace(responses.POST, f"{UPSTREAM}/v1/embeddings", status=501, json={
        "error": {"code": 501, "message": "This server does not support embeddings. "
                  "Start it with `--embeddings`", "type": "not_supported_error"}})
    for path, body in (("/api/embed", {"input": "x"}), ("/api/embeddings", {"prompt": "x"})):
        response = client.post(path, json={"model": NAME, **body})
        assert response.status_code == 501 and "--embeddings" in response.json["error"]


def test_pull_of_the_served_model_and_refused_management(client):
    streamed = client.post("/api/pull", json={"model": NAME})
    assert streamed.mimetype == "application/x-ndjson"
    assert json.loads(streamed.get_data(as_text=True)) == {"status": "success"}
    assert client.post("/api/pull", json={"model": NAME, "stream": False}).json == {
        "status": "success"}
    for method, path, body in (("post", "/api/create", {"model": "new", "from": NAME}),
                               ("post", "/api/push", {"model": NAME}),
                               ("post", "/api/copy", {"source": NAME, "destination": "b"}),
                               ("delete", "/api/delete", {"model": NAME}),
                               ("post", "/api/blobs/sha256:abc", None)):
        response = getattr(client, method)(path, json=body)
        assert response.status_code == 400, path
        assert "one model" in response.json["error"]
    assert client.delete("/api/delete", json={"model": "other"}).status_code == 404
    assert client.head("/api/blobs/sha256:abc").status_code == 404
