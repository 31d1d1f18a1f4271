"""Conversations without an id on the real llama-server: followed by what they share with
saved ones (a first message that changes shape between turns keeps its session) and forked
instead of merged (chats behind one fixed example exchange each keep their own history)."""
from __future__ import annotations

import pytest
import requests

from tests.conftest import long_text

pytestmark = pytest.mark.real

SYSTEM = "You are a coding agent. " + long_text(300, seed=2501)
BODY = "Refactor the module below.\n" + long_text(700, seed=2502)
REMINDER = "<system-reminder>Today's date is 2026-12-04. The working folder is clean." \
           "</system-reminder>"
EXAMPLE_Q = "Here is an example exchange.\n" + long_text(600, seed=2503)
EXAMPLE_A = "And the example's answer.\n" + long_text(300, seed=2504)


def chat(url, messages, headers=None, max_tokens=8):
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": False}
    reply = requests.post(url + "/v1/chat/completions", json=body, headers=headers or {},
                          timeout=300)
    reply.raise_for_status()
    return reply


def reused(reply) -> int:
    data = reply.json()
    timings = data.get("timings") or {}
    if "cache_n" in timings:
        return int(timings["cache_n"])
    return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])


def text_parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


def moved_turns(answer: str):
    """Turn 1 with the reminder in the first user message; turn 2 with it moved to the newest."""
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": text_parts(BODY, REMINDER)}]
    turn2 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": text_parts(BODY)},
             {"role": "assistant", "content": answer},
             {"role": "user", "content": text_parts(REMINDER, "Now add tests.")}]
    return turn1, turn2


def test_a_part_moving_to_the_newest_message_keeps_the_conversation(stack):
    # llama-server alone: the two turns back to back in one slot.
    turn1, _ = moved_turns("")
    first = chat(stack.llama.url, turn1)
    answer = first.json()["choices"][0]["message"]["content"]
    _, turn2 = moved_turns(answer)
    alone = reused(chat(stack.llama.url, turn2))
    # Through kvproxy, with another conversation in between: turn 2 comes back from a file.
    one = chat(stack.url, turn1)
    assert chat(stack.url, turn1).headers["X-KVProxy-Cache"] == "hit"
    chat(stack.url, [{"role": "user", "content": "Something else entirely: " + long_text(200, 9)}],
         headers={"X-Session-Id": "other-chat"})
    two = chat(stack.url, turn2)
    print(f"moved part: kvproxy reused {reused(two)} tokens on turn 2, llama-server alone "
          f"{alone}; prompt {two.json()['usage']['prompt_tokens']}")
    assert two.headers["X-KVProxy-Session"] == one.headers["X-KVProxy-Session"]
    assert two.headers["X-KVProxy-Cache"] == "restored"
    assert reused(two) >= 0.95 * alone, (reused(two), alone)


def test_chats_behind_one_fixed_exchange_are_three_sessions_each_with_its_history(stack):
    opening = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": EXAMPLE_Q},
               {"role": "assistant", "content": EXAMPLE_A}]
    chats = {name: opening + [{"role": "user", "content": f"Real question {name}: "
                               + long_text(120, seed=seed)}]
             for name, seed in (("one", 11), ("two", 12), ("three", 13))}
    opening_tokens = len(requests.post(
        stack.llama.url + "/apply-template", json={"messages": opening}, timeout=60
    ).json().get("prompt", "")) // 8  # a low bound on its tokens: at most 8 characters each
    sessions: dict[str, str] = {}
    figures = []
    for turn in range(3):
        for name, history in chats.items():
            reply = chat(stack.url, history)
            session = reply.headers["X-KVProxy-Session"]
            sessions.setdefault(name, session)
            assert session == sessions[name], (name, turn)
            prompt = reply.json()["usage"]["prompt_tokens"]
            figures.append((name, turn, reply.headers["X-KVProxy-Cache"], reused(reply), prompt))
            if turn > 0:
                assert reply.headers["X-KVProxy-Cache"] == "restored", figures[-1]
                # its own history, not only the shared opening
                assert reused(reply) >= 0.9 * prompt - 40, figures[-1]
            history += [reply.json()["choices"][0]["message"],
                        {"role": "user", "content": f"Turn {turn + 1} of {name}: go on."}]
    print("fixed exchange (chat, turn, cache, reused, prompt):", figures)
    assert len(set(sessions.values())) == 3, sessions
    assert opening_tokens > 0
