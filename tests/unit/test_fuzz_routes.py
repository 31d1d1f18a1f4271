"""Generated JSON thrown at every chat route (hypothesis): input a route cannot use is a 4xx
in that route's own error shape, never a 5xx, and the slot is free afterwards.

llama-server is stubbed with ``responses``; the stub refuses, with llama-server's 400, what
llama-server's own request parsing refuses (wrong types in messages and prompts).
"""
from __future__ import annotations

import json
import re

import pytest
import responses
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproxy import create_app
from tests.fake_llama import UPSTREAM, FakeLlama

FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# -- llama-server stand-in --------------------------------------------------------------
LLAMA_400 = {"error": {"code": 400, "message": "invalid request", "type": "invalid_request_error"}}


LLAMA_500 = {"error": {"code": 500, "type": "server_error", "message":
                       "Failed to parse messages: [json.exception.type_error.302] type must be "
                       "string, but is number"}}


def llama_would_refuse(path: str, body: dict) -> dict | None:
    """The error llama-server's OpenAI endpoints answer a body with, or None.

    As the real one, it answers some malformed messages and tools with a 500.
    """
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return LLAMA_400
        for message in messages:
            if not isinstance(message, dict):
                return LLAMA_400
            if not isinstance(message.get("role"), str):
                return LLAMA_500
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                return LLAMA_400
            if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
                return LLAMA_400
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            return LLAMA_500
    if path.endswith("/completions") and not path.endswith("chat/completions"):
        if not isinstance(body.get("prompt"), (str, list)):
            return LLAMA_400
    if path.endswith("/embeddings") and not isinstance(body.get("input"), (str, list)):
        return LLAMA_400
    return None


def refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def install_llama(mock: responses.RequestsMock, fake: FakeLlama) -> None:
    def answer(request):
        try:  # llama-server's parser refuses NaN and Infinity; so does this stand-in
            body = json.loads(request.body, parse_constant=refuse_constant)
        except ValueError:
            return 500, {"Content-Type": "application/json"}, json.dumps(
                {"error": {"code": 500, "message": "[json.exception.parse_error.101] parse error"}})
        path = request.path_url
        refusal = llama_would_refuse(path, body)
        if refusal:
            return refusal["error"]["code"], {"Content-Type": "application/json"}, \
                json.dumps(refusal)
        if path.endswith("/embeddings"):
            return 200, {"Content-Type": "application/json"}, json.dumps(
                {"data": [{"index": 0, "embedding": [0.1, 0.2]}], "usage": {"prompt_tokens": 1}})
        if path == "/v1/completions":
            return 200, {"Content-Type": "application/json"}, json.dumps(
                {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                 "timings": fake.chat_timings})
        return fake._chat(request)

    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        mock.add_callback(responses.POST, f"{UPSTREAM}{path}", callback=answer)
    mock.add_callback(responses.POST, f"{UPSTREAM}/apply-template", callback=lambda r: (
        200, {}, json.dumps({"prompt": "x"})))
    mock.add_callback(responses.POST, f"{UPSTREAM}/tokenize", callback=lambda r: (
        200, {}, json.dumps({"tokens": [1, 2]})))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    slot_dir = tmp_path_factory.mktemp("fuzz")
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, slot_dir)
        mock.remove(responses.POST, f"{UPSTREAM}/v1/chat/completions")
        install_llama(mock, fake)
        # made before the per-test setting: no background saves, which hold the slot
        yield create_app({"slot_dir": str(slot_dir), "upstream": UPSTREAM, "lock_timeout": 1,
                          "save_behind": False})


# -- generated input --------------------------------------------------------------------
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
JSON = st.recursive(SCALARS, lambda children: st.lists(children, max_size=3)
                    | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=8)
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | JSON},
    optional={"content": JSON | st.text(max_size=5) | st.lists(TEXT_PART | JSON, max_size=2),
              "tool_calls": JSON, "images": JSON, "thinking": JSON, "tool_call_id": JSON,
              "name": JSON})
MESSAGES = st.lists(MESSAGE | JSON, max_size=3) | JSON

ROUTES = {
    "/api/chat": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                  "stream": False},
    "/api/generate": {"model": "tiny", "prompt": "hi", "stream": False},
    "/api/embed": {"model": "tiny", "input": "hi"},
    "/api/embeddings": {"model": "tiny", "prompt": "hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}
FIELDS = ["messages", "prompt", "input", "system", "tools", "tool_choice", "options", "format",
          "think", "stream", "max_tokens", "temperature", "top_p", "stop", "stop_sequences",
          "images", "metadata", "user", "keep_alive", "raw", "suffix", "model", "n_predict",
          "response_format", "seed", "logit_bias", "thinking", "dimensions"]


@st.composite
def mutated(draw, route: str):
    """The route's valid body with some fields replaced by generated JSON."""
    body = dict(ROUTES[route])
    if draw(st.booleans()):
        body["stream"] = True  # errors must also end a stream properly
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        if field == "messages":
            body[field] = draw(MESSAGES)
        elif field == "tools":
            body[field] = draw(st.lists(JSON, max_size=2) | JSON)
        else:
            body[field] = draw(JSON)
    return body


# -- checks -----------------------------------------------------------------------------
def assert_own_error_shape(route: str, status: int, payload) -> None:
    if route.startswith("/v1/messages"):
        assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}, payload
    elif route.startswith("/v1/"):
        assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
        assert payload["error"]["code"] == status
    else:
        assert set(payload) == {"error"} and isinstance(payload["error"], str), payload


def post(app, route: str, data: bytes):
    reply = app.test_client().post(route, data=data, content_type="application/json")
    switch = app.extensions["kvproxy.switch"]
    assert not switch.lock.held_here(), "the slot is still held"
    text = reply.get_data(as_text=True)
    assert reply.status_code < 500, (route, data[:300], reply.status_code, text[:300])
    assert "internal error" not in text, (route, data[:300], text[:300])
    if reply.status_code >= 400:
        assert_own_error_shape(route, reply.status_code, json.loads(text))
    return reply


def encode(body) -> bytes:
    """JSON as a client may send it, NaN and Infinity included (Python writes them)."""
    return json.dumps(body, allow_nan=True).encode()


@pytest.mark.parametrize("route", list(ROUTES))
def test_generated_bodies_never_get_a_5xx(app, route):
    @FUZZ
    @given(body=mutated(route))
    def check(body):
        post(app, route, encode(body))

    check()


@pytest.mark.parametrize("route", list(ROUTES))
@settings(FUZZ, max_examples=40)
@given(body=JSON)
def test_any_json_document_is_answered(app, route, body):
    post(app, route, encode(body))


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "9" * 400])
def test_non_finite_numbers_are_a_400(app, route, literal):
    """llama-server's JSON parser refuses them; kvproxy answers 400 itself."""
    body = encode(ROUTES[route])[:-1] + f', "temperature": {literal}}}'.encode()
    reply = post(app, route, body)
    assert reply.status_code == 400 and re.search("finite|number", reply.get_data(as_text=True))


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("depth", [200, 5000, 100_000])
def test_deeply_nested_json_is_a_400_or_served(app, route, depth):
    body = encode(ROUTES[route])[:-1] + b', "metadata": ' + b"[" * depth + b"]" * depth + b"}"
    reply = post(app, route, body)
    if depth > 1000:
        assert reply.status_code == 400 and "deep" in reply.get_data(as_text=True)
