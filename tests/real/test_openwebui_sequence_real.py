"""OpenWebUI's own call sequence against kvproxy and a real llama-server, field by field.

OpenWebUI (Ollama connection, ENABLE_FORWARD_USER_INFO_HEADERS=true) probes the
server, then streams a chat with X-OpenWebUI-Chat-Id and asks for a title with
a ``### Task:`` request under the same chat id. The title must not cost the
conversation its cached prompt.

The hand-made sequence checks each field OpenWebUI reads; the recorded one
(tests/fixtures/recorded/openwebui: OpenWebUI 0.12.4 itself, two chat turns with its
title, tags and follow-up tasks, made by ``record_clients.py openwebui``) is replayed
in the order OpenWebUI sent it, with its own headers.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import requests

from conftest import count_tokens, long_text
from kvproxy.sessions.identity import SIDE_SESSION
from recorder import load_fixtures

pytestmark = pytest.mark.real

CHAT_ID = "3f1c2a9e-5b7d-4e21-9a0c-7d1e2f3a4b5c"
USER_HEADERS = {"X-OpenWebUI-Chat-Id": CHAT_ID, "X-OpenWebUI-User-Id": "u-1",
                "X-OpenWebUI-User-Name": "Ada", "X-OpenWebUI-User-Email": "ada@example.org",
                "X-OpenWebUI-User-Role": "user"}
RECORDED = load_fixtures(Path(__file__).parents[1] / "fixtures" / "recorded" / "openwebui")
DURATIONS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
             "eval_count", "eval_duration")


def iso(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@pytest.fixture(scope="module")
def model(stack, http):
    """The probes OpenWebUI runs when a connection is added or the model list refreshes."""
    version = http.get(stack.url + "/api/version").json()["version"]
    assert all(part.isdigit() for part in version.split(".")) and len(version.split(".")) == 3
    assert tuple(int(part) for part in version.split(".")) >= (0, 6, 4)  # VS Code Copilot's floor

    entries = http.get(stack.url + "/api/tags").json()["models"]
    assert len(entries) == 1
    entry = entries[0]
    for field in ("name", "model", "modified_at", "size", "digest", "details"):
        assert field in entry, field
    assert entry["name"] == entry["model"] and entry["name"].endswith(":latest")
    assert isinstance(entry["size"], int) and entry["size"] > 0
    iso(entry["modified_at"])

    running = http.get(stack.url + "/api/ps").json()["models"]
    assert running[0]["name"] == entry["name"] and iso(running[0]["expires_at"])
    return entry["name"]


@pytest.fixture(scope="module")
def http():
    """Module-wide, unlike conftest's: the model fixture probes once per module."""
    with requests.Session() as session:
        yield session


def test_show_has_what_openwebui_and_copilot_read(stack, http, model):
    show = http.post(stack.url + "/api/show", json={"model": model}).json()
    info = show["model_info"]
    assert isinstance(info, dict)
    arch = info["general.architecture"]
    assert isinstance(info[f"{arch}.context_length"], int) and info[f"{arch}.context_length"] > 0
    assert "completion" in show["capabilities"]
    assert set(show["details"]) >= {"format", "family", "parameter_size", "quantization_level"}


def stream_chat(stack, http, model, messages):
    response = http.post(stack.url + "/api/chat", headers=USER_HEADERS, stream=True, json={
        "model": model, "messages": messages, "stream": True, "keep_alive": "5m",
        "options": {"num_predict": 12, "temperature": 0.2}})
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/x-ndjson")
    raw_lines = list(response.iter_lines())
    assert raw_lines and all(line.strip() for line in raw_lines)  # no blank keep-alive lines
    chunks = [json.loads(line) for line in raw_lines]
    return response, chunks


def test_chat_stream_then_title_task_keeps_the_conversation_cache(stack, http, model):
    messages = [{"role": "system", "content": long_text(300, 11)},
                {"role": "user", "content": "What does rule 3 say?"}]
    response, chunks = stream_chat(stack, http, model, messages)
    assert response.headers["X-KVProxy-Session"] == CHAT_ID
    assert all(chunk["message"]["role"] == "assistant" for chunk in chunks)
    assert [chunk["done"] for chunk in chunks].count(True) == 1
    final = chunks[-1]
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    for field in DURATIONS:
        assert isinstance(final[field], int) and final[field] >= 0, field
    assert final["eval_count"] > 0 and final["eval_duration"] > 0
    assert final["prompt_eval_count"] > 0
    answer = "".join(chunk["message"]["content"] for chunk in chunks)

    title = http.post(stack.url + "/api/chat", headers=USER_HEADERS, json={
        "model": model, "stream": False, "options": {"num_predict": 8},
        "messages": [{"role": "user", "content": "### Task:\nGenerate a concise title "
                      "for this chat.\n### Chat History:\nUSER: What does rule 3 say?"}]})
    assert title.status_code == 200
    assert title.headers["X-KVProxy-Session"] == SIDE_SESSION  # never saved over the chat
    body = title.json()
    assert body["done"] is True and isinstance(body["message"]["content"], str)

    follow_up = messages + [{"role": "assistant", "content": answer},
                            {"role": "user", "content": "And rule 4?"}]
    response, chunks = stream_chat(stack, http, model, follow_up)
    assert response.headers["X-KVProxy-Session"] == CHAT_ID
    # the side request took the slot: the chat comes back from its own file (not its base
    # snapshot, which would mean the file was lost) and evaluates only the new turn
    assert response.headers["X-KVProxy-Cache"] == "restored"
    assert chunks[-1]["prompt_eval_count"] < 0.2 * count_tokens(stack, messages[0]["content"])


def replay(url: str, record: dict) -> tuple[requests.Response, dict | None]:
    """One recorded request as OpenWebUI sent it, its answer capped at 8 tokens; the reply
    and, for a chat, its last (or only) NDJSON object."""
    body = record["body"]
    if isinstance(body, dict) and "messages" in body:
        body = {**body, "options": {**(body.get("options") or {}), "num_predict": 8}}
    reply = requests.request(record["method"], url + record["path"], headers=record["headers"],
                             json=body if record["method"] == "POST" else None, timeout=600)
    final = json.loads(reply.text.strip().splitlines()[-1]) if "messages" in (body or {}) else None
    return reply, final


def test_recorded_openwebui_chat_keeps_its_slot_through_its_tasks(stack):
    tasks = [r for r in RECORDED if r["method"] == "POST"
             and r["body"]["messages"][-1]["content"].startswith("### Task:")]
    chats = [r for r in RECORDED if r["method"] == "POST" and r not in tasks]
    assert len(chats) == 2 and len(tasks) >= 3  # title, tags and follow-ups
    chat_id = chats[0]["headers"]["x-openwebui-chat-id"]
    assert all(r["headers"]["x-openwebui-chat-id"] == chat_id for r in tasks + chats)
    system_tokens = count_tokens(stack, chats[0]["body"]["messages"][0]["content"])

    turns = []
    for record in RECORDED:
        reply, final = replay(stack.url, record)
        assert reply.status_code == 200, reply.text[:500]
        if record in tasks:
            assert reply.headers["X-KVProxy-Session"] == SIDE_SESSION
            assert final["done"] is True
        elif record in chats:
            assert reply.headers["X-KVProxy-Session"] == chat_id
            turns.append((reply.headers["X-KVProxy-Cache"], final["prompt_eval_count"]))
    print(f"recorded OpenWebUI chat: system prompt {system_tokens} tokens, "
          f"turns (cache, prompt_eval_count) {turns}")
    (first_cache, _), (second_cache, second_evaluated) = turns
    assert first_cache in ("miss", "base")  # a new chat
    # tasks ran in between and took the slot: turn 2 comes back from the chat's own file
    # (not its base snapshot or empty, which would mean a task overwrote or evicted it)
    # and evaluates only what is new, never the system prompt again
    assert second_cache in ("hit", "restored")
    assert second_evaluated < system_tokens
