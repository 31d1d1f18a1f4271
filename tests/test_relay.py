"""The relay between dialects and llama-server, on a stubbed llama-server and the real
switch: side calls, identity of streamed requests, failures that must free the slot, and
the cached model facts."""
import json
import logging

import pytest
import requests
import responses

from kvproxy import create_app
from tests.fake_llama import UPSTREAM, FakeLlama

CHAT = f"{UPSTREAM}/v1/chat/completions"


@pytest.fixture
def fake(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield FakeLlama(mock, tmp_path)


@pytest.fixture
def client(tmp_path, fake):
    return create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 0.3,
                       "base_snapshots": False}).test_client()


def chat(client, session, stream=False, content="hi"):
    return client.post("/v1/chat/completions", headers={"X-Session-Id": session},
                       json={"stream": stream, "messages": [{"role": "user", "content": content}]})


def test_embeddings_run_as_an_unsaved_side_request(client, fake, tmp_path, caplog):
    fake.mock.add(responses.POST, f"{UPSTREAM}/v1/embeddings",
                  json={"data": [{"index": 0, "embedding": [1.0, 0.0]}], "usage": {"prompt_tokens": 2}})
    assert chat(client, "talk").status_code == 200
    with caplog.at_level(logging.INFO, logger="kvproxy.switch"):
        reply = client.post("/api/embed", json={"model": "tiny", "input": "hello"})
    assert "swap to session=side source=side-request cache=miss" in caplog.text
    assert reply.status_code == 200 and reply.json["embeddings"] == [[1.0, 0.0]]
    sent = [json.loads(c.request.body) for c in fake.mock.calls if c.request.url.endswith("/embeddings")]
    assert sent == [{"input": ["hello"], "model": "tiny.gguf", "id_slot": 0}]  # pinned
    assert chat(client, "talk").headers["X-KVProxy-Cache"] == "restored"  # the slot is free again
    assert [a for a, _ in fake.actions] == ["erase", "save", "erase", "restore"], \
        "the side request's slot is never saved"


def test_a_streamed_task_request_stays_in_its_conversation(client):
    """Only whole (stream:false) '### Task:' requests are OpenWebUI side requests."""
    task = "### Task:\nGenerate a title"
    assert chat(client, "chat-9", stream=True, content=task).headers["X-KVProxy-Session"] == "chat-9"
    assert chat(client, "chat-9", stream=False, content=task).headers["X-KVProxy-Session"] == "side"


def test_a_stream_that_cannot_start_frees_the_slot(client, fake):
    fake.mock.replace(responses.POST, CHAT, body=requests.ConnectionError("refused"))
    for _ in range(2):  # a slot still held would make the second one wait and answer 503
        reply = chat(client, "s", stream=True)
        assert reply.status_code == 502, reply.get_data(as_text=True)


def test_a_whole_answer_that_is_not_an_object_frees_the_slot(client, fake):
    fake.mock.replace(responses.POST, CHAT, json=["not", "an", "object"])
    chat(client, "odd")
    fake.mock.replace(responses.POST, CHAT, json={"choices": [], "timings": "garbage"})
    assert chat(client, "odd").status_code == 200
    listing = client.get("/api/sessions").get_json()
    assert [s["hits"] for s in listing if s["session_id"] == "odd"] == [2]


def test_model_facts_are_cached_briefly(client, fake):
    for _ in range(3):
        assert client.get("/api/tags").status_code == 200
    assert sum(c.request.url.endswith("/props") for c in fake.mock.calls) == 1


@pytest.mark.parametrize("entry,props,expected", [
    ({"id": "/models/dir/tiny.gguf"}, {}, "tiny"),
    ({}, {"model_alias": "my-alias"}, "my-alias"),
    ({}, {}, "model"),
])
def test_the_served_name_falls_back_from_the_model_id(tmp_path, fake, entry, props, expected):
    fake.models["data"][0] = {**{k: v for k, v in fake.models["data"][0].items() if k != "id"},
                              **entry}
    fake.props.update(props)
    client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM}).test_client()
    assert client.get("/v1/models").get_json()["data"][0]["id"] == expected


def test_every_generation_asks_llama_server_to_keep_the_prompt_in_the_slot(client, fake):
    chat(client, "s", stream=True)
    chat(client, "s", stream=False)
    sent = [json.loads(c.request.body) for c in fake.mock.calls if c.request.url == CHAT]
    assert [(b["cache_prompt"], b["id_slot"], b["stream"]) for b in sent] == \
        [(True, 0, True), (True, 0, False)]


def test_the_grouping_settings_reach_identity(tmp_path, fake):
    client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                         "anonymous_sessions": "system",
                         "side_request_pattern": "^TASK"}).test_client()
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "TASK: name this chat"}]}
    assert client.post("/v1/chat/completions", json=body).headers["X-KVProxy-Session"] == "side"
    body["messages"][1]["content"] = "hello"
    assert client.post("/v1/chat/completions", json=body).headers["X-KVProxy-Session"] \
        .startswith("sys-")


def test_a_call_marked_side_is_never_saved(tmp_path, fake):
    from kvproxy.relay import ChatCall
    relay = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM}).extensions["kvproxy.relay"]
    session = relay.session_for(ChatCall(body={"messages": []}, side=True), stream=True)
    assert (session.id, session.source, session.persistent) == ("side", "side-request", False)
