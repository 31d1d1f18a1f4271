"""Session identity: priority of every source, hashing fallbacks, hostile ids."""
import json
import os
import re

import pytest

from kvproxy.sessions import identity
from kvproxy.config import load_settings

HEADERS = load_settings({}).session_headers
SYSTEM = [{"role": "system", "content": "You are terse."}]


def resolve(headers=None, body=None, messages=None, stream=True, anonymous="conversation"):
    return identity.resolve(headers or {}, body or {}, messages if messages is not None else SYSTEM,
                            stream=stream, header_names=HEADERS, anonymous=anonymous)


@pytest.mark.parametrize("header", ["X-Session-Id", "X-Conversation-Id", "Session-Id",
                                    "Conversation-Id", "X-OpenWebUI-Chat-Id",
                                    "X-Claude-Code-Session-Id", "X-Session-Affinity",
                                    "X-LiteLLM-Session-Id"])
def test_each_header_names_the_session(header):
    session = resolve(headers={header: "abc-1"}, body={"session_id": "body"})
    assert (session.id, session.source) == ("abc-1", f"header:{header}")


def test_litellms_session_header_names_the_session_as_openhands_sends_it():
    from werkzeug.datastructures import Headers
    session = resolve(headers=Headers({"x-litellm-session-id": "oh-1"}))
    assert session.id == "oh-1"


def test_a_repeated_header_names_the_session_by_its_first_value_whatever_its_case():
    from werkzeug.datastructures import Headers
    headers = Headers([("x-session-id", "first"), ("X-Session-Id", "second")])
    assert resolve(headers=headers).id == "first"
    assert resolve(headers={"x-conversation-id": "lower"}).id == "lower"


def test_headers_follow_the_configured_order():
    headers = {name: f"id-{i}" for i, name in enumerate(HEADERS)}
    for i, name in enumerate(HEADERS):
        assert resolve(headers=headers).id == f"id-{i}"
        headers.pop(name)


@pytest.mark.parametrize("body,expected", [
    ({"metadata": {"user_id": "u_1_session_2"}, "prompt_cache_key": "k", "session_id": "s"},
     ("u_1_session_2", "body:metadata.user_id")),
    ({"prompt_cache_key": "k", "user": "alice", "session_id": "s"}, ("k", "body:prompt_cache_key")),
    ({"user": "alice", "session_id": "s"}, ("alice", "body:user")),
    ({"session_id": "s", "conversation_id": "c"}, ("s", "body:session_id")),
    ({"conversation_id": "c", "chat_id": "x"}, ("c", "body:conversation_id")),
    ({"chat_id": "x", "id": "chat-1"}, ("x", "body:chat_id")),
    ({"id": "chat-42"}, ("chat-42", "body:id")),
    ({"id": "6f1c2a3b-1111-4222-8333-944455556666"},
     ("6f1c2a3b-1111-4222-8333-944455556666", "body:id")),
    ({"session_id": 1234}, ("1234", "body:session_id")),
])
def test_body_fields_in_priority_order(body, expected):
    session = resolve(body=body)
    assert (session.id, session.source) == expected


CLAUDE_USER_ID = json.dumps({"device_id": "0" * 64, "account_uuid": "",
                             "session_id": "ded60c9b-618f-4fe9-96ea-710787c1bb8c"})


def test_claude_code_user_id_json_names_the_same_session_as_its_header():
    by_header = resolve(headers={"X-Claude-Code-Session-Id": "ded60c9b-618f-4fe9-96ea-710787c1bb8c"},
                        body={"metadata": {"user_id": CLAUDE_USER_ID}})
    by_body = resolve(body={"metadata": {"user_id": CLAUDE_USER_ID}})
    assert by_body.id == by_header.id == "ded60c9b-618f-4fe9-96ea-710787c1bb8c"
    assert by_body.key == by_header.key and by_body.source == "body:metadata.user_id"


@pytest.mark.parametrize("user_id", ['{"device_id": "d"}', '{"session_id": ""}', "{not json",
                                     '{"session_id": 5}', '["session_id"]'])
def test_other_user_ids_are_used_as_they_are(user_id):
    assert resolve(body={"metadata": {"user_id": user_id}}).id == user_id


def test_only_metadata_user_id_is_read_as_claude_codes_json():
    """Other fields holding the same JSON are ids as they are; numbers and a missing
    ``metadata`` go on as before."""
    as_it_is = identity.normalise_id(CLAUDE_USER_ID)
    assert resolve(body={"prompt_cache_key": CLAUDE_USER_ID}).id == as_it_is
    assert resolve(body={"metadata": {"user_id": 42}}).id == "42"
    assert resolve(body={"metadata": {}}).id == resolve(body={}).id
    assert resolve(body={}).source == "conversation-hash"


def test_an_id_that_does_not_look_like_a_chat_is_ignored():
    session = resolve(body={"id": "hello world"})
    assert session.source == "conversation-hash"


def test_blank_ids_fall_through():
    assert resolve(headers={"X-Session-Id": "  "}, body={"session_id": ""}).source == \
        "conversation-hash"


def test_conversation_hash_is_stable_as_the_conversation_grows():
    first = SYSTEM + [{"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    other = SYSTEM + [{"role": "user", "content": "a different chat"}]
    assert resolve(messages=first).id == resolve(messages=later).id
    assert resolve(messages=first).id != resolve(messages=other).id
    assert resolve(messages=first).id.startswith("conv-")


def test_system_mode_shares_one_session_per_system_prompt():
    one = resolve(messages=SYSTEM + [{"role": "user", "content": "a"}], anonymous="system")
    two = resolve(messages=SYSTEM + [{"role": "user", "content": "b"}], anonymous="system")
    assert one.id == two.id == "sys-" + identity.short_hash("You are terse.")


def test_system_prompt_is_found_in_every_shape():
    blocks = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]}]
    developer = [{"role": "developer", "content": "You are terse."}]
    for messages in (SYSTEM, blocks, developer):
        assert resolve(messages=messages, anonymous="system").system_hash == \
            identity.short_hash("You are terse.")


def test_no_system_and_no_user_is_default():
    session = resolve(messages=[])
    assert session.id == "default" and not session.persistent


def test_side_requests_are_not_persistent():
    task = [{"role": "user", "content": "### Task:\nGenerate a title"}]
    assert resolve(messages=task, stream=False, headers={"X-OpenWebUI-Chat-Id": "c1"}).id == "side"
    assert resolve(messages=task, stream=True, headers={"X-OpenWebUI-Chat-Id": "c1"}).id == "c1"


HOSTILE = ["../../etc/passwd", "/abs/path", "a\x00b", "..", ".", "x" * 5000, "日本語のチャット",
           "con:aux*?\"<>|", "\\\\server\\share", "a/../../b", "-", "\n\t"]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_ids_stay_in_the_folder(hostile, tmp_path):
    stem = identity.file_stem(hostile)
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,48}-[0-9a-f]{16}", stem)
    assert len(stem.encode()) + len(".json") <= 255
    path = (tmp_path / f"{stem}.bin").resolve()
    assert path.parent == tmp_path.resolve()
    assert ".." not in stem and os.sep not in stem


def test_distinct_ids_get_distinct_files():
    ids = ["a/b", "a_b", "a b", "a:b", "A/B"]
    assert len({identity.file_stem(i) for i in ids}) == len(ids)


def test_base_stems_cannot_be_named_by_a_client():
    assert identity.file_stem("base.0123456789abcdef") != identity.base_stem("0123456789abcdef")


def test_one_client_id_with_two_system_prompts_gets_two_slot_keys():
    main = resolve(headers={"X-Claude-Code-Session-Id": "cc"},
                   messages=[{"role": "system", "content": "main agent"}])
    helper = resolve(headers={"X-Claude-Code-Session-Id": "cc"},
                     messages=[{"role": "system", "content": "title helper"}])
    plain = resolve(headers={"X-Claude-Code-Session-Id": "cc"}, messages=[])
    assert main.id == helper.id == plain.id == "cc"
    assert len({main.key, helper.key, plain.key}) == 3
    assert len({main.stem, helper.stem, plain.stem}) == 3


# -- details the mutation check found unguarded -------------------------------
@pytest.mark.parametrize("session_id,stem", [
    ("chat-1", "chat-1-eaeb9111b1c67442"),
    ("X-ray_", "X-ray-9597394f3e49ccfb"),
    ("Chat ABC/../x", "Chat_ABC_x-569defb6543c132a"),
    ("../../x", "x-9cdf6a50100a862e"),
    ("日本", "session-cf2abf0c5be326cb"),
    ("\ud800", "session-91a681b998555fb4"),  # a lone surrogate from a JSON body
])
def test_file_names_stay_the_same_across_versions(session_id, stem):
    """A session whose file name changes loses its saved cache on upgrade."""
    assert identity.file_stem(session_id) == stem


def test_text_of_joins_text_parts_and_skips_everything_else():
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, "loose", {"text": 3},
             {"type": "text", "text": "b"}]
    assert identity.text_of(parts) == "ab"
    assert identity.text_of(None) == identity.text_of(42) == ""
    assert identity.system_prompt([{"role": "system", "content": "one"},
                                   {"role": "developer", "content": "two"}]) == "one\ntwo"


@pytest.mark.parametrize("messages,stream,expected", [
    ([{"role": "user", "content": "### Task:\nTags"}], False, ("side", "side-request", False)),
    ([], True, ("default", "default", False)),
    (SYSTEM + [{"role": "user", "content": "hi"}], True, (None, "conversation-hash", True)),
])
def test_each_fallback_names_its_source_and_persistence(messages, stream, expected):
    session = identity.resolve({}, {}, messages, stream=stream, header_names=HEADERS)
    session_id, source, persistent = expected
    assert (session.source, session.persistent) == (source, persistent)
    assert session_id is None or session.id == session_id


def test_system_mode_names_its_source():
    session = resolve(messages=SYSTEM, anonymous="system")
    assert (session.source, session.persistent) == ("system-hash", True)


def test_conversation_hash_covers_the_system_prompt_and_keeps_its_hash():
    """Two chats opening with the same question behind different system prompts are
    different conversations; each keeps its system prompt's hash for base snapshots."""
    question = [{"role": "user", "content": "hi"}]
    one = identity.resolve({}, {}, SYSTEM + question, stream=True, header_names=HEADERS)
    two = identity.resolve({}, {}, [{"role": "system", "content": "Other."}] + question,
                           stream=True, header_names=HEADERS)
    assert one.id != two.id
    assert one.system_hash == identity.short_hash("You are terse.")


def test_conversation_ids_stay_the_same_across_versions():
    """An id-less conversation finds its file again after an upgrade."""
    messages = SYSTEM + [{"role": "user", "content": "hi"}]
    assert resolve(messages=messages).id == "conv-11cfbddde3f23bfb"


def test_a_client_id_without_a_system_prompt_keeps_its_plain_key():
    """The key (and so the file name) of a client's session with no system prompt is the id
    alone, as before system prompts were part of keys: its saved file is found again."""
    session = resolve(headers={"X-Session-Id": "abc"}, messages=[{"role": "user", "content": "hi"}])
    assert (session.key, session.system_hash) == ("client:abc", None)
    assert session.stem == "client_abc-495628811944694d"
    assert resolve(messages=[{"role": "user", "content": "hi"}]).system_hash is None, \
        "no system prompt: nothing to make a base snapshot of"


@pytest.mark.parametrize("messages", [None, 5, "system", {"role": "system", "content": "x"}])
def test_messages_that_are_not_a_list_name_no_conversation(messages):
    """A malformed body is the API's to refuse; working out its session must not crash."""
    assert identity.system_prompt(messages) == identity.first_user_message(messages) == ""


@pytest.mark.parametrize("key,kind", [
    (None, "none"), ("", "none"), (identity.client_key("conv-1", "abc"), "client"),
    ("conv-0123", "conversation"), ("sys-0123", "system"), ("default", "default"),
    ("side", "side"), ("base.0123", "other"), ("alice@example.com", "other"),
])
def test_metric_labels_name_the_kind_of_session_never_the_id(key, kind):
    assert identity.kind_of_key(key) == kind


@pytest.mark.parametrize("raw,shown", [
    ("a\uffffb", "a\\uffffb"),                  # a noncharacter at the top of the BMP
    ("a\U000f0000b", "a\\U000f0000b"),          # private use beyond the BMP: eight digits
    ("a\U00010000b", "a\U00010000b"),           # a letter beyond the BMP stays as it is
])
def test_invisible_characters_are_escaped_by_their_code_point(raw, shown):
    assert identity.normalise_id(raw) == shown


def test_ids_up_to_the_bound_are_kept_and_longer_ones_keep_their_start_and_a_hash():
    at_bound = "x" * identity.MAX_ID_CHARS
    assert identity.normalise_id(at_bound) == at_bound
    longer = identity.normalise_id(at_bound + "y")
    start, digest = longer.split("~")
    assert start == "x" * 64 and re.fullmatch(r"[0-9a-f]{16}", digest)


def test_the_fields_the_template_renders_beside_the_system_prompt_name_another_base_only():
    """Two requests with one system prompt and other tools have other system tokens: their
    base snapshots differ, their session (key, stem) does not, so a client that adds a tool
    keeps its conversation."""
    from kvproxy.sessions.identity import resolve
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    plain = resolve({"X-Session-Id": "s"}, {}, messages, stream=True, header_names=["X-Session-Id"])
    tools = resolve({"X-Session-Id": "s"}, {"tools": [tool]}, messages, stream=True,
                    header_names=["X-Session-Id"])
    other = resolve({"X-Session-Id": "s"}, {"tools": [tool, tool]}, messages, stream=True,
                    header_names=["X-Session-Id"])
    assert (plain.key, plain.stem) == (tools.key, tools.stem)
    assert plain.base_hash == plain.system_hash, "no template fields: the base it always had"
    assert len({plain.base_hash, tools.base_hash, other.base_hash}) == 3
    anonymous = resolve({}, {"tools": [tool]}, messages, stream=True, header_names=[])
    assert anonymous.base_hash == tools.base_hash
