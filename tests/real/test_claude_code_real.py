"""Claude Code through kvproxy on the real llama-server: recorded sessions and the real CLI.

The recorded session (tests/fixtures/recorded/claude-code, adapted per turn) is replayed
with its own headers: every turn after the first must run in the same session, from the
slot (``hit``) or from its file after another conversation took the slot (``restored``).
Claude Code's recorded prompt (about 11k tokens with its tools) is larger than the bundled
model's 8192-token context, so the replay cuts every long text to 400 characters and keeps
four tools with empty schemas.

The CLI test runs ``claude -p ... --output-format json`` twice (``--resume``) with
``--bare --tools ""``: the same request shape (system blocks, the environment system
message, thinking, context_management, output_config, betas) with a prompt that fits.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import anthropic
import pytest
import requests

from claude_cli import SMALL_PROMPT_ARGS, claude_binary, run_claude
from claude_code_turns import anonymous, turns
from recorder import load_fixtures

pytestmark = pytest.mark.real

RECORDED = load_fixtures(Path(__file__).parents[1] / "fixtures" / "recorded" / "claude-code")
SHRINK = 400


def send(url: str, record: dict) -> tuple[requests.Response, list[tuple[str, dict]]]:
    """Post one recorded request as the client did; the reply and its SSE events."""
    reply = requests.post(url + record["path"], json=record["body"],
                          headers=record["headers"], timeout=300)
    events = []
    for raw in reply.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in raw.split("\n") if ": " in line)
        if "event" in lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return reply, events


def other_conversation(url: str) -> None:
    """A different conversation takes the slot, so the next turn must come from its file."""
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    client.messages.create(model="claude", max_tokens=4, system="You are a poet.",
                           messages=[{"role": "user", "content": "A haiku, please."}],
                           extra_headers={"x-claude-code-session-id": "someone-else"})


@pytest.mark.parametrize("strip_id", [False, True], ids=["client-id", "anonymous"])
def test_recorded_claude_code_session_stays_one_session(stack, strip_id):
    session = turns(RECORDED, shrink=SHRINK)
    if strip_id:
        session = [anonymous(t) for t in session]
    figures = []
    for number, record in enumerate(session, start=1):
        if number == 3:
            other_conversation(stack.url)
        reply, events = send(stack.url, record)
        assert reply.status_code == 200, reply.text[:500]
        assert [name for name, _ in events][0] == "message_start"
        assert events[-1][0] == "message_stop", events[-1]
        start = events[0][1]["message"]["usage"]
        end = [d for n, d in events if n == "message_delta"][0]["usage"]
        figures.append((reply.headers["X-KVProxy-Cache"], reply.headers["X-KVProxy-Session"],
                        start, end))
    print("\n".join(f"turn {n}: {cache} {sid} start={s} end={e}"
                    for n, (cache, sid, s, e) in enumerate(figures, start=1)))
    caches = [cache for cache, *_ in figures]
    assert caches[1:] == ["hit", "restored", "hit"], caches
    assert len({sid for _, sid, *_ in figures}) == 1
    for cache, _sid, start, end in figures:
        # message_start already has what message_delta reports for the prompt
        assert start["input_tokens"] == end["input_tokens"] > 0
        assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"]
    # the resumed turn reads what the first one left in the slot
    assert figures[1][2]["cache_read_input_tokens"] > figures[0][2]["input_tokens"] // 2


@pytest.fixture(scope="module")
def claude():
    binary = claude_binary()
    if not binary:
        pytest.skip("Claude Code CLI not installed: 'make claude-cli' installs it with npm "
                    "(npm was not found)")
    return binary


@pytest.mark.timeout(900)
def test_claude_code_cli_second_turn_comes_from_the_cache(stack, claude, tmp_path, http):
    # Claude Code sends no temperature and asks for 128000 tokens: a sampled answer of the
    # small model now and then runs on for minutes (measured: 2 runs in 5). Such a session
    # is dropped after 120 s a turn and a new one started, three at most.
    for attempt in range(3):
        home, workdir = tmp_path / f"home{attempt}", tmp_path / f"project{attempt}"
        try:
            first = run_claude(claude, stack.url, "Reply with one word: hello.", home, workdir,
                               extra_args=SMALL_PROMPT_ARGS, timeout=120)
            assert first["is_error"] is False and first["result"], first
            second = run_claude(claude, stack.url, "Reply with one word: again.", home,
                                workdir, resume=first["session_id"],
                                extra_args=SMALL_PROMPT_ARGS, timeout=120)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        pytest.fail("the model ran on past 120 s in three sessions")
    assert second["is_error"] is False and second["session_id"] == first["session_id"], second
    used = second["usage"]
    print(f"\nfirst turn usage: {first['usage']['input_tokens']} input, "
          f"{first['usage']['cache_read_input_tokens']} cache read; second: "
          f"{used['input_tokens']} input, {used['cache_read_input_tokens']} cache read")
    # The second prompt is the first one, its sampled answer and the new question. All of the
    # first prompt must come from the slot: a miss (base snapshot only) reads less than that.
    # How much of the answer is reused again depends on how the CLI sends it back, and that
    # answer's length is sampled, so no share of the whole is asserted.
    first_prompt = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    assert used["cache_read_input_tokens"] >= first_prompt, (first["usage"], used)
    assert first["usage"]["input_tokens"] > 0
    listed = http.get(stack.url + "/api/sessions", timeout=10).json()
    mine = [s for s in listed if s["session_id"] == first["session_id"]]
    # one slot file for the conversation: both turns ran in it, the second from the slot
    assert len(mine) == 1 and mine[0]["hits"] >= 2 and mine[0]["last_cache"] == "hit", listed
