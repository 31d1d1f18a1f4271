"""The real ``anthropic`` SDK against kvproxy under gunicorn and a real llama-server."""
from __future__ import annotations

import json

import anthropic
import pytest

from conftest import long_text

pytestmark = pytest.mark.real

QUESTION = [{"role": "user", "content": "Write one sentence about the weather."}]


@pytest.fixture(scope="module")
def client(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def token_client(stack):
    """Claude Code with ANTHROPIC_AUTH_TOKEN sends ``Authorization: Bearer`` instead."""
    return anthropic.Anthropic(base_url=stack.url, auth_token="x", max_retries=0, timeout=120)


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_create_count_tokens_and_models_with_api_key(client):
    raw = client.messages.with_raw_response.create(
        model="claude-opus-kvproxy", max_tokens=8, system="Answer briefly.", messages=QUESTION,
        extra_body={"temperature": 0})
    message = raw.parse()
    # a conversation no other test has: it starts empty
    assert raw.headers["x-kvproxy-session"].startswith("conv-")
    assert raw.headers["x-kvproxy-cache"] == "miss"
    assert message.model == "claude-opus-kvproxy" and message.id.startswith("msg_")
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model="claude-opus-kvproxy", system="Answer briefly.",
                                           messages=QUESTION)
    assert counted.input_tokens == prompt_tokens(message.usage)
    models = list(client.models.list())
    assert len(models) == 1 and models[0].type == "model" and models[0].id


def test_stream_with_auth_token(token_client):
    with token_client.messages.stream(model="claude-haiku-kvproxy", max_tokens=12,
                                      messages=QUESTION, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[-1].type == "text" and final.content[-1].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert 0 < final.usage.output_tokens <= 12 and prompt_tokens(final.usage) > 10
    assert [m.id for m in token_client.models.list()]
    assert token_client.messages.count_tokens(model="m", messages=QUESTION).input_tokens > 5


def test_stop_sequence_is_reported(client):
    message = client.messages.create(model="claude", max_tokens=16, stop_sequences=["e"],
                                     messages=QUESTION, extra_body={"temperature": 0})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "e"
    assert "e" not in message.content[0].text


def test_structured_output_follows_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    message = client.messages.create(
        model="claude", max_tokens=40, messages=[{"role": "user", "content": "Name a city."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 0})
    assert message.stop_reason == "end_turn"
    assert set(json.loads(message.content[0].text)) == {"city"}


def test_session_switch_a_b_a_reads_the_cache(client):
    """A, then B evicts it from the slot, then A again must come back from A's saved state."""
    def turn(session: str, seed: int, streamed: bool = False):
        kwargs = dict(model="claude-kvproxy", max_tokens=8, system=long_text(500, seed),
                      messages=QUESTION, extra_body={"temperature": 0},
                      extra_headers={"x-claude-code-session-id": session})
        if streamed:
            with client.messages.stream(**kwargs) as stream:
                "".join(stream.text_stream)
                return stream.get_final_message(), stream.response.headers
        raw = client.messages.with_raw_response.create(**kwargs)
        return raw.parse(), raw.headers

    first_a, headers_a = turn("session-A-anthropic", 41)
    first_b, headers_b = turn("session-B-anthropic", 42)
    again_a, headers_again = turn("session-A-anthropic", 41, streamed=True)
    assert headers_a["x-kvproxy-session"] == "session-A-anthropic"
    assert headers_b["x-kvproxy-session"] == "session-B-anthropic"
    assert prompt_tokens(first_b.usage) > 500
    # B started empty: what it reads from cache is only the prefill of its own system prompt
    # (the base snapshot made before its first answer), never A's conversation.
    assert headers_b["x-kvproxy-cache"] == "miss" and first_b.usage.input_tokens > 0
    total = prompt_tokens(again_a.usage)
    assert total == prompt_tokens(first_a.usage)
    assert again_a.usage.cache_read_input_tokens >= 0.9 * total, again_a.usage
    assert headers_again["x-kvproxy-cache"] == "restored"


def test_raw_stream_ends_with_message_stop(stack, http):
    """The SDK tolerates a stream without message_stop; the raw event sequence must have it."""
    reply = http.post(stack.url + "/v1/messages", stream=True, timeout=120,
                      headers={"x-api-key": "x", "anthropic-version": "2023-06-01"},
                      json={"model": "claude", "max_tokens": 8, "stream": True,
                            "temperature": 0, "messages": QUESTION})
    assert reply.status_code == 200
    lines = [line for line in reply.iter_lines(decode_unicode=True) if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names, "each event line names its data's type"
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"] and names.count("message_stop") == 1
    blocks = [n for n in names if n in ("content_block_start", "content_block_stop")]
    assert blocks and blocks == ["content_block_start", "content_block_stop"] * (len(blocks) // 2)


SCREENSHOT_TOOL = {"name": "screenshot", "description": "A screenshot of the screen",
                   "input_schema": {"type": "object", "properties": {}}}
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJ"
       "RU5ErkJggg==")  # one pixel


def screenshot_turn(result: list[dict]) -> list[dict]:
    """A coding agent's turn: the model asked for a screenshot, the tool returns ``result``."""
    return [{"role": "user", "content": "What is on my screen?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": result}]}]


def counted_client(url: str) -> tuple[anthropic.Anthropic, list]:
    """The SDK with its default retries, and the list of requests it sends."""
    sent: list = []
    http = anthropic.DefaultHttpxClient(event_hooks={"request": [sent.append]})
    return anthropic.Anthropic(base_url=url, api_key="x", timeout=120, http_client=http), sent


def test_a_screenshot_for_a_text_only_model_is_one_400_and_a_text_result_is_answered(stack):
    """llama-server's 500 for an image it cannot see would be retried; kvproxy's 400 is not
    (docs/clients.md, "Where kvproxy answers differently")."""
    image = [{"type": "text", "text": "Screen:"},
             {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": PNG}}]
    client, sent = counted_client(stack.url)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="m", max_tokens=4, tools=[SCREENSHOT_TOOL],
                               messages=screenshot_turn(image))
    assert refused.value.status_code == 400 and len(sent) == 1
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "image input is not supported" in refused.value.body["error"]["message"]

    direct, sent_direct = counted_client(stack.llama.url)
    with pytest.raises(anthropic.InternalServerError):
        direct.with_options(max_retries=1).messages.create(
            model="m", max_tokens=4, tools=[SCREENSHOT_TOOL], messages=screenshot_turn(image))
    assert len(sent_direct) == 2  # what the 400 spares: a retry that cannot succeed

    message = client.messages.create(
        model="m", max_tokens=4, tools=[SCREENSHOT_TOOL], extra_body={"temperature": 0},
        messages=screenshot_turn([{"type": "text", "text": "A terminal with a blue prompt."}]))
    assert message.type == "message" and message.usage.output_tokens > 0
