"""The comparison the conformance suite relies on: it must see the differences clients see,
allow only those its table lists, and the table must be what docs/clients.md shows."""
import json
from pathlib import Path

import pytest

from tests.conformance import (DIFFERENCES, Difference, Entry, bounded, differences, form_of,
                               key_paths, load_corpus, markdown_table, stream_events)

CLIENTS_DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"


def sse(*events):
    out = ""
    for name, data in events:
        payload = data if isinstance(data, str) else json.dumps(data)
        out += (f"event: {name}\n" if name else "") + f"data: {payload}\n\n"
    return out


def test_key_paths_ignore_values_but_not_structure():
    assert key_paths({"a": 1, "b": [{"c": "x"}, {"c": "y"}]}) == \
        key_paths({"a": 2, "b": [{"c": "z"}]})
    assert key_paths({"a": None}) != key_paths({"a": {"b": 1}})
    assert key_paths({"a": {}}) != key_paths({"a": {"b": 1}})


def test_stream_events_collapse_repeats_and_keep_order():
    text = sse(("message_start", {}), ("content_block_delta", {}), ("content_block_delta", {}),
               ("message_stop", {}))
    assert stream_events(text) == ["message_start", "content_block_delta", "message_stop"]
    chunks = sse((None, {"choices": [{"delta": {"role": "assistant"}}]}),
                 (None, {"choices": [{"delta": {"content": "a"}}]}),
                 (None, {"choices": [{"delta": {"content": "b"}}]}),
                 (None, {"choices": [{"delta": {}, "finish_reason": "stop"}]}), (None, "[DONE]"))
    assert len(stream_events(chunks)) == 4 and stream_events(chunks)[-1] == "[DONE]"
    assert stream_events(sse((None, {"type": "response.created"}))) == ["response.created"]


def test_differences_see_what_a_client_sees():
    ok = form_of(200, "application/json", '{"a": 1}')
    assert differences(ok, form_of(200, "application/json", '{"a": 5}')) == []
    assert differences(ok, form_of(400, "application/json", '{"a": 1}'))
    assert differences(ok, form_of(200, "application/json", '{"b": 1}'))
    assert differences(ok, form_of(200, "application/json", '{"a": 1, "b": 1}'))
    assert differences(ok, form_of(200, "text/event-stream", sse((None, {"a": 1}))))
    error = form_of(400, "application/json", '{"error": {"message": "m", "code": 400}}')
    richer = form_of(400, "application/json",
                     '{"error": {"message": "m", "code": 400, "param": null}}')
    assert differences(error, richer) == [] and differences(richer, error)
    one = form_of(200, "text/event-stream", sse(("a", {}), ("b", {})))
    assert differences(one, form_of(200, "text/event-stream", sse(("b", {}), ("a", {}))))


def test_generation_is_capped_without_changing_anything_else():
    assert bounded({"messages": [], "max_tokens": 32000, "x": 1}) == \
        {"messages": [], "max_tokens": 8, "x": 1, "temperature": 0}
    assert bounded({"prompt": "p"})["max_tokens"] == 8
    assert bounded({"content": "tokenize me"}) == {"content": "tokenize me"}
    assert bounded({"messages": [], "options": {"num_predict": 99}})["options"] == \
        {"num_predict": 8, "temperature": 0}
    assert "options" not in bounded({"messages": []})  # not an Ollama request
    assert bounded({"messages": [], "stream": False}, ollama=True)["options"] == \
        {"num_predict": 8, "temperature": 0}
    assert bounded({"model": "m"}, ollama=True) == {"model": "m"}  # /api/show: no generation


def test_a_temperature_the_client_sent_is_kept():
    """Hand-made cases send bad temperatures on purpose; greedy is only the default."""
    assert bounded({"input": "x", "temperature": "hot"})["temperature"] == "hot"
    assert bounded({"messages": [], "options": {"temperature": 0.7}}, ollama=True)["options"] == \
        {"temperature": 0.7, "num_predict": 8}


def test_corpus_loads_hand_made_and_recorded_requests(tmp_path):
    (tmp_path / "conformance").mkdir()
    (tmp_path / "recorded" / "sdk").mkdir(parents=True)
    (tmp_path / "conformance" / "01-a.json").write_text(json.dumps(
        {"method": "GET", "path": "/props", "headers": {}, "body": None}))
    (tmp_path / "recorded" / "sdk" / "01-b.json").write_text(json.dumps(
        {"method": "POST", "path": "/api/chat", "headers": {"Host": "x", "X-Session-Id": "s"},
         "body": {"messages": []}}))
    corpus = load_corpus(tmp_path)
    assert [e.name for e in corpus] == ["conformance/01-a.json", "recorded/sdk/01-b.json"]
    assert corpus[0].direct and not corpus[1].direct  # Ollama: kvproxy only
    assert corpus[1].request_kwargs()["headers"] == {"X-Session-Id": "s",
                                                     "Content-Type": "application/json"}
    assert json.loads(corpus[1].request_kwargs()["data"])["options"] == \
        {"num_predict": 8, "temperature": 0}
    assert not Entry("x", "GET", "/v1/x", expect={"direct": False}).direct


ADDS_KEYS = Difference("GET /x", "any", "a", "a, b", "why", adds_keys=True)
ADDS_PING = Difference("POST /x", "stream", "events", "events, ping", "why",
                       adds_events=("ping",))
REFUSES = Difference("POST /x", "empty", "200", "400 `x: required`", "why", (200, 400),
                     "x: required")


def test_additions_are_allowed_only_where_a_row_lists_them():
    direct = form_of(200, "application/json", '{"a": 1}')
    richer = form_of(200, "application/json", '{"a": 1, "b": 2}')
    assert differences(direct, richer, ADDS_KEYS) == []
    assert differences(richer, direct, ADDS_KEYS)  # never fewer
    assert differences(direct, direct, ADDS_KEYS)  # the row no longer holds
    pinged = form_of(200, "text/event-stream", sse(("a", {}), ("ping", {}), ("b", {})))
    plain = form_of(200, "text/event-stream", sse(("a", {}), ("b", {})))
    assert differences(plain, pinged) and differences(plain, pinged, ADDS_PING) == []
    assert differences(plain, plain, ADDS_PING)


def test_a_refusal_must_be_exactly_as_its_row_says():
    answered = form_of(200, "application/json", '{"content": []}')
    refused = form_of(400, "application/json", '{"error": {"message": "x: required"}}')
    assert differences(answered, refused) and differences(answered, refused, REFUSES) == []
    other = form_of(400, "application/json", '{"error": {"message": "x: bad"}}')
    assert differences(answered, other, REFUSES)  # another message
    assert differences(answered, answered, REFUSES)  # kvproxy no longer refuses
    assert differences(refused, refused, REFUSES)  # llama-server refuses too now
    assert differences(None, refused, REFUSES) == []  # kvproxy only
    assert differences(None, answered, REFUSES)


def test_every_row_is_exercised_by_the_corpus_and_every_entry_names_a_row():
    used = {entry.expect["differs"] for entry in load_corpus() if "differs" in entry.expect}
    assert used == set(DIFFERENCES)


def test_an_entry_naming_no_row_is_refused(tmp_path):
    (tmp_path / "conformance").mkdir()
    (tmp_path / "conformance" / "01-a.json").write_text(json.dumps(
        {"path": "/v1/x", "expect": {"differs": "nowhere"}}))
    with pytest.raises(ValueError, match="nowhere"):
        load_corpus(tmp_path)


def test_docs_list_the_differences_the_suite_allows():
    assert markdown_table() in CLIENTS_DOC.read_text(), \
        "docs/clients.md is out of date: python -m tests.conformance prints its table"
    for row in DIFFERENCES.values():  # the docs name the text an operator searches for
        assert row.message is None or row.message in row.kvproxy, row
