"""The relay between dialects and llama-server, on a stubbed llama-server and the real
switch: side calls, identity of streamed requests, failures that must free the slot, and
the cached model facts."""
import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import responses

from kvproxy import create_app
from kvproxy.sessions.identity import Session
from kvproxy.relay.answer import Answer, timings_from_usage
from kvproxy.relay.context import ChatCall
from kvproxy.relay.prompt import Prompt
from kvproxy.slots.switch import ClientGone
from tests.fake_llama import UPSTREAM

CHAT = f"{UPSTREAM}/v1/chat/completions"



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
        assert reply.status_code == 503, reply.get_data(as_text=True)


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
    relay = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM}).extensions["kvproxy.relay"]
    session = relay.session_for(ChatCall(body={"messages": []}, side=True), stream=True)
    assert (session.id, session.source, session.persistent) == ("side", "side-request", False)


# -- what a whole answer without timings tells the switch -------------------------------
@pytest.mark.parametrize("result,timings", [
    ({"usage": {"input_tokens": 12, "output_tokens": 3,
                "input_tokens_details": {"cached_tokens": 8}}},
     {"cache_n": 8, "prompt_n": 4, "predicted_n": 3}),
    ({"usage": {"input_tokens": 12}}, {"cache_n": 0, "prompt_n": 12, "predicted_n": 0}),
    ({"usage": {"input_tokens": 12, "input_tokens_details": {}}},
     {"cache_n": 0, "prompt_n": 12, "predicted_n": 0}),
    ({"usage": {"input_tokens": 12, "input_tokens_details": ["odd"]}},
     {"cache_n": 0, "prompt_n": 12, "predicted_n": 0}),
    ({"usage": {"input_tokens": 0, "output_tokens": 0}}, {"cache_n": 0, "prompt_n": 0, "predicted_n": 0}),
    ({"usage": {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 5}}},
     {"cache_n": 5, "prompt_n": 0, "predicted_n": 0}),
    ({"usage": {"output_tokens": 3}}, {}),     # no prompt count: nothing to record
    ({"choices": []}, {}),
    (["not", "an", "object"], {}),
    (None, {}),
])
def test_a_responses_api_answer_counts_its_tokens_from_its_usage(result, timings):
    """llama-server's whole Responses API answer carries ``usage`` instead of ``timings``."""
    assert timings_from_usage(result) == timings
    lease = SimpleNamespace(headers=lambda timings=None: {}, prefill=None)
    assert Answer(None, lease, result).timings == timings


# -- the prompt as the switch sees it (base snapshots, restore checks) ------------------
class TemplatingClient:
    """llama-server's /apply-template and /tokenize in miniature: ChatML, one token per
    character, 1 for the start token, and one token for "\n<" (so token boundaries can
    differ where the system prompt alone ends)."""

    def __init__(self):
        self.templated, self.tokenized = [], []

    def apply_template(self, body):
        self.templated.append(body)
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in body["messages"])
        return text + ("<|assistant|>" if body["add_generation_prompt"] is True else "")

    def tokenize(self, text, add_special=False):
        self.tokenized.append((text, add_special))
        tokens, i = ([1] if add_special is True else []), 0
        while i < len(text):
            if text.startswith("\n<", i):
                tokens.append(2)
                i += 2
            else:
                tokens.append(ord(text[i]))
                i += 1
        return tokens


SYSTEM_TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def prompt_of(body):
    client = TemplatingClient()
    return Prompt(client, ChatCall(body=body)), client


def test_the_prompt_is_templated_for_an_answer_and_tokenized_with_its_start_token():
    prompt, client = prompt_of({"messages": SYSTEM_TURN, "stream": True, "max_tokens": 9,
                                "temperature": 0.1, "tools": [{"type": "function"}],
                                "tool_choice": "auto", "chat_template_kwargs": {"x": 1},
                                "reasoning_format": "none"})
    assert prompt.templated() == "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"
    assert prompt.tokens()[0] == 1
    assert client.templated == [{"messages": SYSTEM_TURN, "add_generation_prompt": True,
                                 "tools": [{"type": "function"}], "tool_choice": "auto",
                                 "chat_template_kwargs": {"x": 1}, "reasoning_format": "none"}], \
        "only what changes the template is sent with the messages"
    prompt.tokens()
    assert len(client.templated) == len(client.tokenized) == 1, "worked out once"


@pytest.mark.parametrize("body,text", [({"prompt": "Once upon"}, "Once upon"),
                                       ({"prompt": [1, 2, 3]}, ""), ({}, "")])
def test_a_completion_prompt_is_its_own_text(body, text):
    prompt, client = prompt_of(body)
    assert prompt.templated() == text and client.templated == []


@pytest.mark.parametrize("role", ["system", "developer"])
def test_the_system_tokens_are_the_leading_tokens_of_the_system_prompt_alone(role):
    messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt, client = prompt_of({"messages": messages})
    head = prompt.system_tokens()
    # "\n<" is one token in the full prompt: the system part's last "\n" is not shared
    assert head == [1] + [ord(c) for c in f"<|{role}|>Be brief."]
    assert head == prompt.tokens()[:len(head)]
    assert client.templated[0] == {"messages": messages[:1], "add_generation_prompt": False}


def test_a_system_prompt_exactly_at_the_minimum_still_gets_its_tokens():
    prompt, _ = prompt_of({"messages": SYSTEM_TURN})
    size = len(json.dumps(["Be brief."]))
    assert prompt.system_tokens(size) is not None
    assert prompt.system_tokens(size + 1) is None


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Be brief."}],                 # nothing after it
    [{"role": "user", "content": "hi"}],                          # no system prompt
    [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
])
def test_no_system_tokens_without_a_leading_system_prompt_and_a_turn_after_it(messages):
    prompt, client = prompt_of({"messages": messages})
    assert prompt.system_tokens() is None and client.templated == []


# -- a client that left while waiting for the slot ---------------------------------------
def test_a_request_whose_client_left_while_waiting_costs_no_swap(tmp_path, fake):
    relay = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 10,
                        "base_snapshots": False}).extensions["kvproxy.relay"]
    held = relay.switch.acquire(Session("holder", "test"))
    outcome = []

    def late():
        call = ChatCall(body={"messages": [{"role": "user", "content": "hi"}]},
                        headers={"X-Session-Id": "late"}, still_wanted=lambda: False)
        try:
            outcome.append(relay.complete(call))
        except ClientGone as exc:
            outcome.append(exc)

    thread = threading.Thread(target=late)
    thread.start()
    deadline = time.monotonic() + 5
    while relay.switch.pool.waiting != 1:
        assert time.monotonic() < deadline, "the request never waited"
        time.sleep(0.01)
    actions = list(fake.actions)
    relay.switch.release(held)
    thread.join(5)
    assert isinstance(outcome[0], ClientGone)
    assert fake.actions == actions, "no save, restore or erase for a client that left"


@pytest.mark.parametrize("path,body,field,value", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", 2),
    ("/v1/completions", {"prompt": "Once", "n": 3}, "n", 3),
    ("/completion", {"prompt": "Once", "n_cmpl": 2, "n": 1}, "n_cmpl", 2),
    ("/v1/responses", {"input": "hi", "n": 2.0}, "n", 2.0),
])
def test_a_request_for_several_answers_is_refused_before_the_slot_is_taken(
        client, fake, path, body, field, value):
    """llama-server runs each answer after the first in another idle slot, over the
    conversation kvproxy keeps there: refused in the client's API's shape, nothing sent."""
    reply = client.post(path, headers={"X-Session-Id": "alice"}, json=body)
    assert reply.status_code == 400
    message = reply.get_json()["error"]["message"]
    assert f"'{field}' is {value}" in message and "one completion per request" in message
    assert not [c for c in fake.mock.calls if "/slots" in c.request.url
                or c.request.url.endswith(path)]


@pytest.mark.parametrize("body", [{"n": 1}, {"n_cmpl": 1, "n": 5}, {"n": None}, {"n": "2"},
                                  {"n": True}, {}])
def test_one_answer_or_a_value_llama_server_judges_is_not_refused(client, body):
    reply = client.post("/v1/chat/completions", headers={"X-Session-Id": "bob"},
                        json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert reply.status_code == 200, reply.get_data(as_text=True)


# -- the application layer: its caller, its one side path, its boundaries ----------------
def test_a_caller_is_scoped_by_its_user_with_keys_and_by_its_client_without():
    from kvproxy.errors import ClientError
    from kvproxy.relay.context import Caller, scope_of
    assert Caller("alice", "192.0.2.1", "curl").scope(keys_set=True) == ("alice", None)
    assert Caller(None, "192.0.2.1", "curl").scope(keys_set=False) == \
        (None, "192.0.2.1\x00curl")
    with pytest.raises(ClientError) as refused:
        Caller(None, "192.0.2.1", "curl").scope(keys_set=True)  # never unscoped with keys
    assert refused.value.status == 401
    assert scope_of(None, keys_set=True) == (None, None), "a call from code is unscoped"


def test_the_session_follows_the_caller_handed_in(tmp_path, fake):
    from kvproxy.relay.context import Caller
    relay = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM}).extensions["kvproxy.relay"]
    body = {"messages": [{"role": "user", "content": "hello"}]}
    here = relay.session_for(ChatCall(body=body, raw=body, caller=Caller(None, "192.0.2.1", "a")),
                             stream=False)
    there = relay.session_for(ChatCall(body=body, raw=body, caller=Caller(None, "192.0.2.2", "a")),
                              stream=False)
    assert here.source == there.source == "conversation-hash" and here.key != there.key


def test_every_side_request_runs_on_the_switch_and_client_of_the_model_it_names(monkeypatch):
    """Ollama's embeddings (built by kvproxy) and passthrough side routes (relayed as they
    came) take the one side path: routed by model, pinned to the side task's slot."""
    import contextlib
    from kvproxy.relay import side
    from kvproxy.relay.context import RawCall

    class Client:
        def __init__(self, model):
            self.model, self.sent = model, []

        def _named(self, body):
            return {**body, "model": self.model}

        def post_json(self, path, body):
            self.sent.append((path, body))
            return {"ok": True}

        def forward(self, method, path, **kwargs):
            self.sent.append((path, json.loads(kwargs["data"])))
            return SimpleNamespace(status_code=200, headers={})

        def content(self, upstream):
            return b"{}"

    clients = {"a": Client("router-a"), "b": Client("router-b")}
    routed = []
    models = SimpleNamespace(route=lambda model: routed.append(model) or (model, clients[model]))
    lease = SimpleNamespace(slot=1, headers=lambda: {"X-KVProxy-Session": "side"})
    held = []
    monkeypatch.setattr(side, "side_task",
                        contextlib.contextmanager(lambda switch: (held.append(switch), (yield lease))))
    assert side.side_json(models, "/v1/embeddings", {"model": "a", "input": "x"}) == {"ok": True}
    reply = side.side_relayed(models, RawCall("POST", "/v1/rerank", data=b'{"model": "b"}',
                                              model="b"))
    assert routed == held == ["a", "b"]
    assert clients["a"].sent == [("/v1/embeddings", {"model": "router-a", "input": "x",
                                                     "id_slot": 1})]
    assert clients["b"].sent == [("/v1/rerank", {"model": "b", "id_slot": 1})]
    assert reply.headers == {"X-KVProxy-Session": "side"} and reply.content == b"{}"
