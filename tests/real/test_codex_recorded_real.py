"""Codex CLI through kvproxy on the real llama-server: the recorded two-turn session.

tests/fixtures/recorded/codex holds what Codex CLI 0.171 sent for ``codex exec`` and
``codex exec resume`` (``record_clients.py codex``): a 4,600-token prompt (its
instructions, skills and permissions as developer messages, twelve tools), the session id
as the ``Session-Id`` header and as ``prompt_cache_key``. Replayed with its own headers,
the second turn must run in the first one's session and read the first one's prompt from
the slot (``hit``), or from its file after another conversation took the slot
(``restored``), and say so in the Responses usage Codex reads.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from recorder import load_fixtures

pytestmark = [pytest.mark.real, pytest.mark.timeout(1800)]

RECORDED = load_fixtures(Path(__file__).parents[1] / "fixtures" / "recorded" / "codex")


def send(url: str, record: dict) -> tuple[requests.Response, dict]:
    """One recorded turn, its answer capped at 4 tokens; the reply and its final usage."""
    body = {**record["body"], "max_output_tokens": 4}
    reply = requests.post(url + record["path"], json=body, headers=record["headers"],
                          timeout=900)
    assert reply.status_code == 200, reply.text[:500]
    completed = [json.loads(line[5:]) for line in reply.text.splitlines()
                 if line.startswith("data:") and '"response.completed"' in line]
    assert completed, reply.text[-500:]
    return reply, completed[-1]["response"]["usage"]


def test_recorded_codex_session_reuses_its_prompt(stack):
    first, second = RECORDED
    assert first["headers"]["session-id"] == second["headers"]["session-id"]
    assert second["body"]["input"][:4] == first["body"]["input"]  # turn 2 extends turn 1
    session = first["headers"]["session-id"]

    figures = []
    reply, first_usage = send(stack.url, first)
    figures.append((reply.headers["X-KVProxy-Cache"], reply.headers["X-KVProxy-Session"],
                    first_usage))
    reply, usage = send(stack.url, second)
    figures.append((reply.headers["X-KVProxy-Cache"], reply.headers["X-KVProxy-Session"], usage))
    other = requests.post(stack.url + "/v1/responses", timeout=300, json={
        "instructions": "You are a poet.", "input": "A haiku, please.", "max_output_tokens": 4,
        "prompt_cache_key": "someone-else"})
    assert other.status_code == 200 and other.headers["X-KVProxy-Session"] == "someone-else"
    reply, usage = send(stack.url, second)
    figures.append((reply.headers["X-KVProxy-Cache"], reply.headers["X-KVProxy-Session"], usage))
    print("\n".join(f"turn {n}: {cache} {sid} {use}" for n, (cache, sid, use)
                    in enumerate(figures, start=1)))

    assert [cache for cache, *_ in figures] == [figures[0][0], "hit", "restored"]
    assert figures[0][0] in ("miss", "base")
    assert {sid for _, sid, _ in figures} == {session}
    prompt = first_usage["input_tokens"]
    assert prompt > 4000  # Codex's own prompt, evaluated once
    for _, _, use in figures[1:]:
        # the whole first turn comes from the slot; only the new turn is evaluated
        assert use["input_tokens_details"]["cached_tokens"] >= 0.95 * prompt, use
