"""Hostile session ids from every header and body field on every API: always answered,
never a stuck slot, and safe in reply headers, log lines, metrics and file names."""
from __future__ import annotations

import logging
import re

import pytest
import responses

from kvproxy import create_app
from kvproxy.sessions import identity
from kvproxy.storage.store import SessionStore
from kvproxy.slots.lease import header_safe
from tests.fake_llama import UPSTREAM, FakeLlama, stem_of

HOSTILE = {
    "lone-surrogate": "\ud800",
    "surrogate-inside": "abc\udfffdef",
    "newline": "a\r\nX-Evil: 1",
    "controls": "\x00\x07\x1b[31mred\x7f",
    "separators": "a\u2028b\u2029c\u200b",
    "very-long": "z" * 100_000,
    "long-unicode": "日本語" * 5000,
    "percent": "100%",
    "path": "../../etc/passwd",
}

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def app_and_fake(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 2,
                          "base_snapshots": False})
        yield app, fake


def chat_request(api: str, field: str, value: str) -> tuple[str, dict, dict]:
    """Path, headers and JSON body of one chat request carrying ``value`` in ``field``."""
    headers, body = {}, {}
    if field.startswith("header:"):
        headers[field[7:]] = value
    elif field == "metadata.user_id":
        body["metadata"] = {"user_id": value}
    else:
        body[field] = value
    if api == "ollama":
        return "/api/chat", headers, {"model": "tiny", "messages": USER, "stream": False, **body}
    if api == "openai":
        return "/v1/chat/completions", headers, {"messages": USER, **body}
    return "/v1/messages", headers, {"model": "m", "max_tokens": 2, "messages": USER, **body}


FIELDS = {
    "ollama": ["header:X-Session-Id", "header:X-OpenWebUI-Chat-Id", "session_id", "chat_id",
               "user"],
    "openai": ["header:X-Session-Id", "user", "prompt_cache_key", "conversation_id"],
    "anthropic": ["header:X-Claude-Code-Session-Id", "metadata.user_id", "session_id"],
}


def sendable_as_header(value: str) -> bool:
    """Header values travel as latin-1 text without line breaks: only what a client can send."""
    return all(ord(c) < 256 and c not in "\r\n\x00" for c in value)


CASES = [(api, field, name) for api, fields in FIELDS.items() for field in fields
         for name, value in HOSTILE.items()
         if not field.startswith("header:") or sendable_as_header(value)]


def assert_slot_free(app, client) -> None:
    switch = app.extensions["kvproxy.switch"]
    assert not switch.lock.held_here(), "the slot is still held"
    again = client.post("/v1/chat/completions", json={"messages": USER})
    assert again.status_code == 200


@pytest.mark.parametrize("api,field,name", CASES)
def test_hostile_ids_are_answered_and_leave_the_slot_free(app_and_fake, caplog, api, field, name):
    caplog.set_level(logging.INFO, logger="kvproxy")
    app, _fake = app_and_fake
    client = app.test_client()
    path, headers, body = chat_request(api, field, HOSTILE[name])
    reply = client.post(path, headers=headers, json=body)
    assert reply.status_code == 200, reply.get_data(as_text=True)[:300]
    shown = reply.headers["X-KVProxy-Session"]
    assert shown.isascii() and shown.isprintable() and len(shown) < 1000
    assert "X-Evil" not in reply.headers
    for record in caplog.records:  # one event, one printable line
        line = record.getMessage()
        assert "\n" not in line and "\r" not in line and line.isprintable(), line
        line.encode("utf-8")
    for file in SessionStore(app.config["KVPROXY"].slot_dir).root.iterdir():
        assert re.fullmatch(r"[A-Za-z0-9_.@-]+", file.name)
    samples = [line for line in client.get("/metrics").get_data(as_text=True).splitlines()
               if not line.startswith("#")]
    assert not any(HOSTILE[name][:20] in line for line in samples)
    assert_slot_free(app, client)


def test_the_issue_reproducer_is_a_200_and_frees_the_slot(app_and_fake):
    """A lone surrogate in Claude Code's metadata.user_id used to be a 500 and a stuck slot."""
    app, _ = app_and_fake
    client = app.test_client()
    raw = b'{"model":"m","max_tokens":2,"metadata":{"user_id":"\\ud800"},' \
          b'"messages":[{"role":"user","content":"hi"}]}'
    reply = client.post("/v1/messages", data=raw, headers={"content-type": "application/json",
                                                           "x-api-key": "k"})
    assert reply.status_code == 200 and reply.json["type"] == "message"
    assert reply.headers["X-KVProxy-Session"] == r"\ud800"
    assert_slot_free(app, client)


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"caf\xc3\xa9", b"a\xc3", b"\xed\xa0\x80"])
def test_header_bytes_that_are_not_utf8_are_escaped(app_and_fake, raw):
    app, _ = app_and_fake
    client = app.test_client()
    reply = client.post("/v1/chat/completions", json={"messages": USER},
                        environ_overrides={"HTTP_X_SESSION_ID": raw.decode("latin-1")})
    assert reply.status_code == 200
    expected = identity.normalise_id(raw.decode("utf-8", "backslashreplace"))
    from urllib.parse import unquote
    assert unquote(reply.headers["X-KVProxy-Session"]) == expected
    assert_slot_free(app, client)


def test_a_body_that_is_not_utf8_is_a_400(app_and_fake):
    app, _ = app_and_fake
    client = app.test_client()
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
        reply = client.post(path, data=b'{"messages": [{"role": "user", "content": "\xff"}]}',
                            content_type="application/json")
        assert reply.status_code == 400, (path, reply.get_data(as_text=True))
    assert_slot_free(app, client)


def test_an_id_in_surrogate_bytes_is_answered(app_and_fake):
    """UTF-8 bytes of a lone surrogate (Python's JSON reads them as one): answered, slot free."""
    app, _ = app_and_fake
    client = app.test_client()
    body = b'{"user": "\xed\xa0\x80", "model": "tiny", "max_tokens": 2, "stream": false, ' \
           b'"messages": [{"role": "user", "content": "hi"}]}'
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
        reply = client.post(path, data=body, content_type="application/json")
        assert reply.status_code in (200, 400), (path, reply.get_data(as_text=True))
        assert reply.headers.get("X-KVProxy-Session", r"\ud800") == r"\ud800"
    assert_slot_free(app, client)


@pytest.mark.parametrize("text,decoded", [("\ud800", r"\ud800"), ("a\udfffb", r"a\udfffb"),
                                          ("日本\ud800", r"日本\ud800")])
def test_a_lone_surrogate_reaches_a_reply_header_as_its_escape(text, decoded):
    """Ids are normalised before they reach a header, but the header is written after the
    slot was taken: it must never raise, whatever text it is given."""
    from urllib.parse import unquote
    shown = header_safe(text)
    assert shown.isascii() and shown.isprintable()
    assert unquote(shown) == decoded


# -- normalisation ------------------------------------------------------------------
@pytest.mark.parametrize("value", list(HOSTILE.values()) + ["ok-id", "日本語", "a b"])
def test_normalised_ids_are_printable_bounded_and_stable(value):
    clean = identity.normalise_id(value)
    assert clean.isprintable() and len(clean) <= identity.MAX_ID_CHARS
    clean.encode("utf-8")
    assert identity.normalise_id(clean) == clean


def test_long_ids_that_differ_only_at_the_end_stay_apart():
    one, two = "x" * 5000 + "1", "x" * 5000 + "2"
    assert identity.normalise_id(one) != identity.normalise_id(two)


def test_plain_ids_are_kept_as_sent():
    for value in ("chat-42", "alice@example.com", "日本語のチャット", "a b c"):
        assert identity.normalise_id(value) == value


# -- namespace ----------------------------------------------------------------------
INTERNAL = ["default", "side", "conv-0123456789abcdef", "sys-0123456789abcdef",
            "base.0123456789abcdef", "base:0123456789abcdef"]


@pytest.mark.parametrize("value", INTERNAL)
def test_no_client_value_names_an_internal_key_or_file(value):
    for headers, body in (({"X-Session-Id": value}, {}), ({}, {"session_id": value}),
                          ({}, {"metadata": {"user_id": value}})):
        for messages in (USER, [{"role": "system", "content": "s"}] + USER):
            session = identity.resolve(headers, body, messages, stream=True,
                                       header_names=("X-Session-Id",))
            assert session.id == value and session.persistent
            assert session.key.startswith(identity.CLIENT_NAMESPACE)
            assert session.stem not in {identity.file_stem(v) for v in INTERNAL}
            anonymous = identity.resolve({}, {}, messages, stream=True,
                                         header_names=("X-Session-Id",))
            assert session.stem != anonymous.stem, "the id must not name the anonymous file"
            assert identity.kind_of_key(session.key) == "client"


def test_a_client_naming_a_conversation_gets_its_own_file(app_and_fake):
    """An anonymous conversation's id sent as a client id neither restores nor overwrites it."""
    app, fake = app_and_fake
    client = app.test_client()
    mine = {"messages": [{"role": "user", "content": "my private question"}]}
    first = client.post("/v1/chat/completions", json=mine)
    conv = first.headers["X-KVProxy-Session"]
    assert conv.startswith("conv-")
    probe = client.post("/v1/chat/completions", headers={"X-Session-Id": conv},
                        json={"messages": [{"role": "user", "content": "what did they ask?"}]})
    assert probe.headers["X-KVProxy-Session"] == conv
    assert probe.headers["X-KVProxy-Cache"] == "miss", "the probe must not get the conversation"
    conv_file = f"{stem_of(conv)}.bin"
    conv_save = ("save", f"{stem_of(conv)}.saving.bin")  # checked, then renamed
    assert ("restore", conv_file) not in fake.actions
    assert [a for a in fake.actions if a == conv_save] == [conv_save]
    assert (fake.slot_dir / conv_file).is_file()
    back = client.post("/v1/chat/completions", json=mine)
    assert back.headers["X-KVProxy-Cache"] == "restored"
    assert fake.actions[-1] == ("restore", conv_file)


def test_a_hostile_client_id_is_listed_and_deleted_by_its_shown_form(app_and_fake):
    app, fake = app_and_fake
    client = app.test_client()
    raw = b'{"user": "\\ud800 a\\nb", "messages": [{"role": "user", "content": "hi"}]}'
    shown = client.post("/v1/chat/completions", data=raw,
                        content_type="application/json").headers["X-KVProxy-Session"]
    client.post("/v1/chat/completions", json={"messages": USER})  # saves the client's file
    from urllib.parse import quote, unquote
    listed = [s["session_id"] for s in client.get("/api/sessions").get_json()]
    assert unquote(shown) in listed
    assert client.delete("/api/sessions/" + quote(unquote(shown), safe="")).status_code == 204
    assert unquote(shown) not in [s["session_id"] for s in client.get("/api/sessions").get_json()]
