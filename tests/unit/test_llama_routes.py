"""llama-server's own routes through kvproxy, against a stubbed llama-server.

Generation routes (/v1/responses, /infill, /completion) run in a session with
the slot pinned; passthrough routes come back exactly as llama-server answered.
"""
import json

import pytest
import responses

from flask import request

from kvproxy import create_app, routes
from tests.fake_llama import UPSTREAM

RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "output": [],
            "usage": {"input_tokens": 30, "output_tokens": 2, "total_tokens": 32,
                      "input_tokens_details": {"cached_tokens": 20}}}
RESPONSE_STREAM = (
    'event: response.created\ndata: {"type":"response.created"}\n\n'
    'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"o"}\n\n'
    'event: response.completed\ndata: {"type":"response.completed","response":{},'
    '"timings":{"cache_n":5,"prompt_n":3,"predicted_n":1}}\n\n')



@pytest.fixture
def app(tmp_path, fake):
    return create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False})


def sent(fake, path):
    return [json.loads(call.request.body) for call in fake.mock.calls
            if call.request.url == UPSTREAM + path]


def answer_responses(fake):
    def callback(_request):
        fake.tokens = 32
        return 200, {"Content-Type": "application/json"}, json.dumps(RESPONSE)
    fake.mock.add_callback(responses.POST, f"{UPSTREAM}/v1/responses", callback=callback)


def test_responses_run_in_a_session_with_the_slot_pinned(app, fake):
    answer_responses(fake)
    body = {"model": "m", "instructions": "sys", "input": "hi", "max_output_tokens": 4,
            "store": False}
    reply = app.test_client().post("/v1/responses", json=body)
    assert reply.status_code == 200 and reply.get_json() == RESPONSE
    assert reply.headers["X-KVProxy-Cache"] == "miss"
    assert reply.headers["X-KVProxy-Session"].startswith("conv-")
    upstream = sent(fake, "/v1/responses")[0]
    assert upstream == {**body, "stream": False, "cache_prompt": True, "id_slot": 0}
    again = app.test_client().post("/responses", json={**body, "input": [
        {"role": "user", "content": "hi"}, {"role": "user", "content": "more"}]})
    assert again.headers["X-KVProxy-Cache"] == "hit"
    assert again.headers["X-KVProxy-Session"] == reply.headers["X-KVProxy-Session"]


def test_responses_usage_is_recorded_as_timings(app, fake, tmp_path):
    """A whole Responses answer has no timings: its usage tells what the cache did."""
    answer_responses(fake)
    reply = app.test_client().post("/v1/responses", json={"input": "x", "prompt_cache_key": "k"})
    assert reply.status_code == 200 and reply.headers["X-KVProxy-Session"] == "k"
    state = json.loads((tmp_path / ".kvproxy-state.json").read_text())["slots"]["0"]
    assert state["active"] == "k" and state["slot_tokens"] == 32
    sidecar = json.loads(next(tmp_path.glob("client_k-*.json")).read_text())
    assert (sidecar["last_cache_n"], sidecar["last_prompt_n"]) == (20, 10)


def test_responses_stream_keeps_named_events(app, fake):
    fake.mock.add(responses.POST, f"{UPSTREAM}/v1/responses", body=RESPONSE_STREAM,
                  content_type="text/event-stream")
    reply = app.test_client().post("/v1/responses", json={"input": "hi", "stream": True})
    assert reply.status_code == 200 and reply.mimetype == "text/event-stream"
    assert reply.get_data(as_text=True) == RESPONSE_STREAM
    assert sent(fake, "/v1/responses")[0]["stream"] is True


def test_upstream_refusal_keeps_its_status(app, fake):
    """llama-server refuses previous_response_id: the client hears it, with its status."""
    fake.mock.add(responses.POST, f"{UPSTREAM}/v1/responses", status=400, json={"error": {
        "code": 400, "message": "llama.cpp does not support 'previous_response_id'.",
        "type": "invalid_request_error"}})
    reply = app.test_client().post("/v1/responses",
                                   json={"input": "x", "previous_response_id": "resp_0"})
    assert reply.status_code == 400
    assert "previous_response_id" in reply.get_json()["error"]["message"]
    assert reply.get_json()["error"]["type"] == "invalid_request_error"


def test_infill_runs_in_the_editor_session(app, fake):
    fake.mock.add(responses.POST, f"{UPSTREAM}/infill",
                  json={"content": "x", "timings": {"cache_n": 0, "prompt_n": 9}})
    body = {"input_prefix": "def f(", "input_suffix": ")\n", "prompt": "",
            "input_extra": [{"filename": "a.py", "text": "a = 1\n"}], "n_predict": 4}
    reply = app.test_client().post("/infill", json=body)
    assert reply.status_code == 200 and reply.get_json()["content"] == "x"
    assert reply.headers["X-KVProxy-Session"] == "infill"
    assert sent(fake, "/infill")[0] == {**body, "stream": False, "cache_prompt": True, "id_slot": 0}


@pytest.mark.parametrize("path", ["/completion", "/completions"])
def test_native_completion_goes_to_the_native_route(app, fake, path):
    fake.mock.add(responses.POST, f"{UPSTREAM}/completion", json={"content": "y", "timings": {}})
    reply = app.test_client().post(path, json={"prompt": "Once", "n_predict": 2})
    assert reply.status_code == 200 and reply.get_json()["content"] == "y"
    assert sent(fake, "/completion")[0]["id_slot"] == 0


def test_every_passthrough_route_is_served(app):
    rules = {rule.rule: rule.methods for rule in app.url_map.iter_rules()}
    for route in routes.ROUTES:
        if route.family != "passthrough":
            continue
        assert set(route.methods) <= rules[route.path], route.path
        with app.test_request_context(route.path, method=route.methods[0]):
            assert routes.error_shape(app.url_map, request) == routes.OPENAI, route.path
    for path in ("/infill", "/responses", "/v1/responses", "/completion", "/completions"):
        reply = app.test_client().get(path)  # wrong method: llama-server's error shape
        assert reply.status_code == 405 and reply.get_json()["error"]["type"], path


def test_slot_actions_are_refused_without_reaching_llama_server(app, fake):
    reply = app.test_client().post("/slots/0?action=erase", json={})
    assert reply.status_code == 403 and "/api/sessions" in reply.get_json()["error"]["message"]
    assert fake.actions == []


def test_plain_routes_relay_answers_and_errors_unchanged_without_the_slot(app, fake):
    fake.mock.add(responses.POST, f"{UPSTREAM}/tokenize", json={"tokens": [1, 2]})
    error = {"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}}
    fake.mock.add(responses.POST, f"{UPSTREAM}/detokenize", status=400, json=error)
    client = app.test_client()
    reply = client.post("/tokenize", data=b'{"content":"hi"}', content_type="application/json")
    assert reply.status_code == 200 and reply.get_json() == {"tokens": [1, 2]}
    forwarded = [c.request for c in fake.mock.calls if c.request.url.endswith("/tokenize")][0]
    assert forwarded.body == b'{"content":"hi"}'
    reply = client.post("/detokenize", json={"tokens": "no"})
    assert reply.status_code == 400 and reply.get_json() == error
    assert client.get("/props?autoload=false").get_json() == fake.props
    assert fake.mock.calls[-1].request.url == f"{UPSTREAM}/props?autoload=false"
    assert fake.actions == []  # no save, restore or erase
    assert not any(c.request.url.endswith("/slots") for c in fake.mock.calls)


def test_side_routes_take_the_slot_as_a_side_request(app, fake):
    fake.mock.add(responses.POST, f"{UPSTREAM}/v1/chat/completions/input_tokens", json={"n": 1})
    fake.mock.add(responses.POST, f"{UPSTREAM}/v1/embeddings", status=501, json={"error": {
        "code": 501, "message": "This server does not support embeddings.",
        "type": "not_supported_error"}})
    client = app.test_client()
    chat = client.post("/v1/chat/completions", headers={"X-Session-Id": "A"},
                       json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200
    reply = client.post("/v1/embeddings", json={"input": "x"})
    assert reply.status_code == 501
    assert reply.get_json()["error"]["type"] == "not_supported_error"
    assert reply.headers["X-KVProxy-Session"] == "side"
    assert [a for a, _ in fake.actions][-2:] == ["save", "erase"]  # A saved, then the side task
    assert routes.BY_PATH["/v1/embeddings"].endpoint == routes.SIDE


def test_unreachable_llama_server_answers_in_openai_shape(tmp_path):
    app = create_app({"slot_dir": str(tmp_path), "upstream": "http://127.0.0.1:9"})
    for reply in (app.test_client().post("/tokenize", json={"content": "x"}),
                  app.test_client().post("/v1/rerank", json={"query": "q", "documents": ["d"]})):
        assert reply.status_code == 503 and reply.headers["Retry-After"] == "5"
        assert {"message", "type", "param", "code"} <= set(reply.get_json()["error"])


def test_models_keep_llama_servers_fields_under_the_served_name(app, fake):
    """Maki's llama.cpp provider reads data[].meta (context size) from /v1/models."""
    fake.mock.replace(responses.GET, f"{UPSTREAM}/v1/models", json={
        "models": [{"name": "tiny.gguf", "model": "tiny.gguf", "capabilities": ["completion"]}],
        "object": "list", "data": [{"id": "tiny.gguf", "object": "model", "created": 1,
                                    "owned_by": "llamacpp", "meta": {"n_ctx_train": 8192}}]})
    listing = app.test_client().get("/v1/models").get_json()
    assert listing["data"][0]["meta"] == {"n_ctx_train": 8192}
    assert listing["data"][0]["id"] == "tiny" and listing["object"] == "list"
    assert listing["models"] == [{"name": "tiny", "model": "tiny", "capabilities": ["completion"]}]


@pytest.mark.parametrize("path", ["/props", "/lora-adapters"])
def test_server_wide_changes_need_the_admin_token_when_one_is_set(tmp_path, fake, path):
    fake.mock.add(responses.POST, f"{UPSTREAM}{path}", json={"success": True})
    fake.mock.add(responses.GET, f"{UPSTREAM}/lora-adapters", json=[])
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "admin_token": "s3cret"})
    client = app.test_client()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = client.post(path, json={}, headers=headers)
        assert refused.status_code == 401
        assert "admin token" in refused.get_json()["error"]["message"]
    assert not any(c.request.method == "POST" and c.request.url == UPSTREAM + path
                   for c in fake.mock.calls)
    assert client.get(path).status_code == 200  # reading needs no token
    allowed = client.post(path, json={}, headers={"Authorization": "Bearer s3cret"})
    assert allowed.status_code == 200 and allowed.get_json() == {"success": True}


def test_server_wide_changes_pass_without_a_configured_token(app, fake):
    fake.mock.add(responses.POST, f"{UPSTREAM}/lora-adapters", json={"success": True})
    assert app.test_client().post("/lora-adapters", json=[]).status_code == 200
