"""A conversation keeps its session across a client's turns.

Replays the recorded Claude Code session (adapted per turn: a mid-conversation system
message, tools removed and added, old thinking blocks trimmed) through the Anthropic
translation and the identity rules, with and without the client's session id.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from werkzeug.datastructures import Headers

from claude_code_turns import anonymous, turns
from kvproxy.sessions import identity
from kvproxy.config import load_settings
from kvproxy.translate import anthropic as anthropic_translate
from recorder import load_fixtures

RECORDED = load_fixtures(Path(__file__).parents[1] / "fixtures" / "recorded" / "claude-code")
HEADERS = load_settings(environ={}).session_headers


def session_of(record: dict) -> identity.Session:
    body = record["body"]
    messages = anthropic_translate.to_llama(body)["messages"]
    return identity.resolve(Headers(record["headers"]), body, messages, stream=True,
                            header_names=HEADERS)


@pytest.mark.parametrize("strip_id", [False, True], ids=["client-id", "anonymous"])
def test_claude_code_session_keeps_its_key_on_every_turn(strip_id):
    session = [anonymous(t) if strip_id else t for t in turns(RECORDED)]
    keys = [session_of(turn).key for turn in session]
    assert len(set(keys)) == 1, keys
    if strip_id:
        assert keys[0].startswith("conv-")
    else:
        client_id = RECORDED[0]["headers"]["x-claude-code-session-id"]
        assert keys[0].startswith(identity.CLIENT_NAMESPACE + client_id + "#")


def test_a_system_message_added_mid_conversation_keeps_the_key():
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    noted = plain[:3] + [{"role": "system", "content": "Mode changed."}] + plain[3:]
    for headers in ({"X-Session-Id": "s1"}, {}):
        first = identity.resolve(headers, {}, plain[:2], stream=True, header_names=HEADERS)
        later = identity.resolve(headers, {}, noted, stream=True, header_names=HEADERS)
        assert first.key == later.key and first.system_hash == later.system_hash


def test_leading_system_messages_still_name_the_prompt():
    """Two leading system messages are the prompt; a different one is another session."""
    two = [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
           {"role": "user", "content": "Hi"}]
    other = [{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"}]
    assert identity.system_prompt(two) == "A\nB"
    assert identity.resolve({}, {}, two, stream=True, header_names=HEADERS).key != \
        identity.resolve({}, {}, other, stream=True, header_names=HEADERS).key
