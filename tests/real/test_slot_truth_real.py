"""One slot, one truth, against the real llama-server with several slots: a request for
several answers cannot overwrite another conversation's slot, and a stress of conversations,
embeddings, requests for several answers and deletions, interleaved, never makes a reply's
``X-KVProxy-Cache`` disagree with its usage, never switches restoring off, and leaves every
settled turn on disk with a sidecar that matches its file.

``KVPROXY_STRESS_SECONDS`` sets the stress's length (default 180)."""
from __future__ import annotations

import json
import os
import random
import threading
import time

import openai
import pytest
import requests

from kvproxy.slots.restore_check import slot_file_tokens
from kvproxy.storage.store import SessionStore
from tests.conftest import Stack, long_text
from tests.support import stem_of

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

EMBEDDINGS = ["--embeddings", "--pooling", "last"]
# A hit or restored turn reuses at least its previous prompt, less these tokens (the last
# sampled token is never decoded; templates may re-render the end of the last answer).
SLACK = 8
STRESS_SECONDS = float(os.environ.get("KVPROXY_STRESS_SECONDS", "180"))
MIN_STEPS = 10   # per conversation thread, however slow the machine: one is a deletion


def ask(url: str, session: str, history: list[dict], max_tokens: int = 8) -> dict:
    reply = requests.post(url + "/v1/chat/completions", headers={"X-Session-Id": session},
                          json={"messages": history, "max_tokens": max_tokens,
                                "temperature": 0}, timeout=300)
    assert reply.status_code == 200, reply.text[:300]
    body = reply.json()
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return {"cache": reply.headers["X-KVProxy-Cache"], "prompt": body["usage"]["prompt_tokens"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def test_a_request_for_two_answers_leaves_another_conversations_slot_alone(tmp_path):
    """The review's repro: alice and bob in two slots, alice asks for two answers. llama-server
    would run the second in bob's idle slot; kvproxy refuses it in OpenAI's format and bob's
    next turn reuses his whole conversation."""
    stack = Stack(tmp_path, slots=2, llama_args={"ctx_size": 8192, "cache_ram_mib": 0},
                  KVPROXY_BASE_SNAPSHOTS="false").start()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
        chats = {name: [{"role": "system", "content": long_text(1200, seed=i)},
                        {"role": "user", "content": f"Hello, I am {name}."}]
                 for i, name in enumerate(("alice", "bob"))}
        first = {name: ask(stack.url, name, history) for name, history in chats.items()}
        chats["alice"].append({"role": "user", "content": "Two short ideas, please."})
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=chats["alice"], n=2, max_tokens=8,
                                           extra_headers={"X-Session-Id": "alice"})
        assert refused.value.status_code == 400
        assert "one completion per request" in refused.value.body["message"]
        chats["bob"].append({"role": "user", "content": "And now?"})
        bob = ask(stack.url, "bob", chats["bob"])
        print(f"\nfirst turns {first}; bob after alice's n=2: {bob}")
        assert bob["cache"] in ("hit", "restored")
        assert bob["cached"] >= 0.9 * bob["prompt"], bob
    finally:
        stack.stop()


class Stress:
    """Conversations taking turns on their own threads, beside embeddings, requests for two
    answers and deletions; every reply checked as it comes."""

    def __init__(self, url: str, sessions: list[str], seconds: float):
        self.url, self.sessions, self.until = url, sessions, time.monotonic() + seconds
        self.talking = threading.Event()   # cleared once every conversation thread is done
        self.talking.set()
        self.problems: list[str] = []
        self.counts: dict[str, int] = {}
        self.last_prompt: dict[str, int] = {}
        self.histories: dict[str, list[dict]] = {}
        self.lock = threading.Lock()

    def note(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def fresh(self, session: str, seed: int) -> None:
        self.histories[session] = [
            {"role": "system", "content": long_text(80 + 10 * (seed % 10), seed=seed)},
            {"role": "user", "content": f"Conversation {session}: tell me something."}]
        self.last_prompt.pop(session, None)

    def conversation(self, owned: list[str], seed: int) -> None:
        rng = random.Random(seed)
        for i, session in enumerate(owned):
            self.fresh(session, seed * 10 + i)
        turns = 0
        # Time-bound, but never fewer than MIN_STEPS steps: a slow machine still deletes and
        # still returns to its conversations.
        while time.monotonic() < self.until or turns < MIN_STEPS:
            session = rng.choice(owned)
            turns += 1
            if turns % 7 == 0:   # every seventh step deletes a conversation instead
                reply = requests.delete(f"{self.url}/api/sessions/{session}", timeout=120)
                if reply.status_code not in (200, 204, 404):
                    self.problems.append(f"DELETE {session}: {reply.status_code} {reply.text}")
                self.fresh(session, rng.randrange(1000))
                self.note("delete")
                continue
            history = self.histories[session]
            got = ask(self.url, session, history)
            self.note(got["cache"])
            before = self.last_prompt.get(session)
            if got["cache"] in ("hit", "restored"):
                if before is None:
                    self.problems.append(f"{session}: {got['cache']} on its first turn: {got}")
                elif got["cached"] < before - SLACK:
                    self.problems.append(f"{session}: {got['cache']} reused {got['cached']} of "
                                         f"{got['prompt']} (its last prompt was {before})")
            self.last_prompt[session] = got["prompt"]
            history.append({"role": "user", "content": f"Go on ({len(history)})."})
            if len(history) > 24:   # keep within the slot's context: a new conversation
                self.fresh(session, rng.randrange(1000))

    def embeddings(self) -> None:
        while self.talking.is_set():
            reply = requests.post(self.url + "/v1/embeddings", json={
                "input": [f"passage {i} {time.monotonic()}" for i in range(8)]}, timeout=300)
            if reply.status_code != 200:
                self.problems.append(f"embeddings: {reply.status_code} {reply.text[:200]}")
            self.note("embeddings")
            time.sleep(0.2)

    def several_answers(self) -> None:
        while self.talking.is_set():
            reply = requests.post(self.url + "/v1/chat/completions", headers={
                "X-Session-Id": random.choice(self.sessions)}, json={
                "messages": [{"role": "user", "content": "Two answers?"}], "n": 2,
                "max_tokens": 4}, timeout=60)
            if reply.status_code != 400:
                self.problems.append(f"n=2 answered {reply.status_code}")
            self.note("n=2")
            time.sleep(2)


def test_interleaved_conversations_side_tasks_and_deletions_keep_every_record_true(tmp_path):
    stack = Stack(tmp_path, slots=2,
                  llama_args={"ctx_size": 8192, "cache_ram_mib": 0, "extra_args": EMBEDDINGS},
                  KVPROXY_SAVE_BEHIND_DELAY="0.5").start()
    try:
        sessions = [f"s{i}" for i in range(6)]   # three per slot
        stress = Stress(stack.url, sessions, STRESS_SECONDS)
        talkers = [threading.Thread(target=stress.conversation, args=(sessions[i::3], i))
                   for i in range(3)]
        side = [threading.Thread(target=stress.embeddings),
                threading.Thread(target=stress.several_answers)]
        threads = talkers + side
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + STRESS_SECONDS + 500   # within the test's 900 s
        for thread in talkers:
            thread.join(max(1.0, deadline - time.monotonic()))
        stress.talking.clear()
        for thread in side:
            thread.join(120)
        print(f"\nstress of {STRESS_SECONDS:.0f} s: {stress.counts}")
        assert not any(thread.is_alive() for thread in threads)
        assert stress.problems == []
        assert stress.counts.get("hit", 0) + stress.counts.get("restored", 0) >= 5
        assert stress.counts.get("embeddings", 0) >= 3 and stress.counts.get("delete", 0) >= 1
        status = requests.get(stack.url + "/api/status", timeout=30).json()
        assert not status["restore_check"]["restoring_off"], status["restore_check"]
        assert status["restore_check"]["models_off"] == 0
        # Every settled turn on disk: save behind has run; each file matches its sidecar.
        time.sleep(3)
        listed = {s["session_id"]: s for s in requests.get(
            stack.url + "/api/sessions", timeout=30).json() if s.get("kind") == "session"}
        for session, last in stress.last_prompt.items():
            assert session in listed, f"{session}'s last turn is not on disk"
            path = stack.slot_dir / listed[session]["file"]
            sidecar = json.loads(path.with_suffix(".json").read_text())
            assert SessionStore(stack.slot_dir).bin_bytes(stem_of(path.name)) == \
                sidecar["saved_bytes"], session
            tokens = slot_file_tokens(path)   # whole, or from its manifest
            assert tokens is not None and len(tokens) == sidecar["n_tokens"], session
            assert sidecar["n_tokens"] >= last, f"{session}: its settled turn is not on disk"
    finally:
        stack.stop()
