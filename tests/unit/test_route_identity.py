"""Session identity of the Responses API and of fill-in-the-middle requests."""
from kvproxy.sessions import identity
from kvproxy.sessions.route_identity import (infill_session, responses_identity_body,
                                    responses_messages)

HEADERS = ("X-Session-Id",)


def resolve(body, headers=None, stream=True):
    return identity.resolve(headers or {}, responses_identity_body(body),
                            responses_messages(body), stream=stream, header_names=HEADERS)


def test_instructions_are_the_system_prompt_and_text_input_the_user():
    assert responses_messages({"instructions": "be brief", "input": "hi"}) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_item_lists_keep_roles_and_text_and_skip_role_less_items():
    body = {"input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q1"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "a1"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "42"},
        "garbage", {"role": "user", "content": 7}]}
    assert responses_messages(body) == [
        {"role": "developer", "content": "rules"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": ""}]


def test_hostile_bodies_give_no_messages():
    for body in ({"input": 5}, {"input": None, "instructions": ["x"]}, {}):
        assert responses_messages(body) == []


def test_a_growing_conversation_keeps_its_session():
    first = {"instructions": "sys", "input": [{"role": "user", "content": "hello"}]}
    second = {"instructions": "sys", "input": first["input"] + [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        {"role": "user", "content": "more"}]}
    one, two = resolve(first), resolve(second)
    assert one.source == "conversation-hash" and one.key == two.key
    assert one.system_hash == identity.short_hash("sys")
    other = resolve({"instructions": "sys", "input": "another chat"})
    assert other.key != one.key


def test_prompt_cache_key_and_conversation_name_the_session():
    assert resolve({"input": "x", "prompt_cache_key": "codex-1"}).id == "codex-1"
    named = resolve({"input": "x", "conversation": {"id": "conv_7"}, "user": "alice"})
    assert (named.id, named.source) == ("conv_7", "body:conversation_id")
    assert resolve({"input": "x", "conversation": "conv_8"}).id == "conv_8"
    assert resolve({"input": "x", "user": "alice"}).id == "alice"
    assert resolve({"input": "x", "prompt_cache_key": "p"}, {"X-Session-Id": "h"}).id == "h"


def test_infill_is_one_session_per_editor_apart_from_chats():
    body = {"input_prefix": "def f(", "input_suffix": ")",
            "input_extra": [{"filename": "a.py", "text": "x = 1"}]}
    anonymous = infill_session({}, body, HEADERS)
    assert anonymous.id == "infill" and anonymous.persistent and anonymous.system_hash is None
    edited = infill_session({}, {**body, "input_prefix": "def g(", "prompt": "ab"}, HEADERS)
    assert edited.key == anonymous.key
    named = infill_session({"X-Session-Id": "ed-1"}, body, HEADERS)
    assert named.id == "ed-1" and named.key != "ed-1"  # never the key of ed-1's chat
    assert named.key != anonymous.key


def test_infill_with_a_file_name_gets_a_session_per_file():
    one = infill_session({}, {"filename": "a.py"}, HEADERS)
    two = infill_session({}, {"filename": "b.py"}, HEADERS)
    assert one.key != two.key and one.key == infill_session({}, {"filename": "a.py"}, HEADERS).key
    hostile = infill_session({}, {"filename": "../../etc/passwd"}, HEADERS)
    assert "/" not in hostile.stem and ".." not in hostile.stem


def test_recorded_codex_request_is_named_by_its_session():
    """Codex CLI 0.171 sends its session id as a Session-Id header and as prompt_cache_key."""
    import json
    from pathlib import Path
    recorded = json.loads((Path(__file__).parents[1] / "fixtures/recorded/codex/"
                           "01-responses-first-turn.json").read_text())
    body = recorded["body"]
    from werkzeug.datastructures import Headers
    session = identity.resolve(Headers(recorded["headers"]), responses_identity_body(body),
                               responses_messages(body), stream=True,
                               header_names=("X-Session-Id", "Session-Id"))
    assert (session.id, session.source) == (body["prompt_cache_key"], "header:Session-Id")
    without_header = resolve(body)
    assert without_header.id == body["prompt_cache_key"]
    assert without_header.system_hash  # developer messages are its system prompt
