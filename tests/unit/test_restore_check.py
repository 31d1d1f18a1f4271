"""The restore check's own bookkeeping and upstream calls: its counts under concurrency, and
the prompt it tokenizes while holding a slot."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from kvproxy.slots.restore_check import RestoreCheck
from kvproxy.upstream import llama
from kvproxy.upstream.llama import LlamaClient, UpstreamUnavailable
from kvproxy.relay.context import ChatCall
from kvproxy.relay.prompt import Prompt

MOMENT = 0.3


def test_two_threads_counting_misses_lose_neither(tmp_path, monkeypatch):
    """Two answers judged at once in one process: filelock with ``thread_local=False`` is
    re-entrant across threads, so its lock alone let both read the same count and write the
    same next one (one miss lost, a switch-off late)."""
    check = RestoreCheck(tmp_path, miss_limit=0, off_minutes=60)
    real_read = check._read
    others: list[threading.Thread] = []

    def read_then_another_thread_counts():
        data = real_read()
        if not others:
            other = threading.Thread(target=check.record, args=("k", False), daemon=True)
            others.append(other)
            other.start()
            other.join(MOMENT)   # finishes here unless the lock keeps it out
        return data
    monkeypatch.setattr(check, "_read", read_then_another_thread_counts)
    check.record("k", False)
    others[0].join(10)
    assert check.entries()["k"]["misses"] == 2


@pytest.fixture
def stalled_llama():
    """A llama-server that accepts connections and never answers (stuck, or swapping)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize("ask", ["tokens", "system_tokens"])
def test_the_prompt_of_a_held_slot_gives_up_on_a_stalled_llama_server_soon(
        stalled_llama, monkeypatch, ask):
    """The restore check tokenizes the prompt and a base snapshot templates it, both while the
    slot is held: bounded by the short read timeout, not the generation's (600 s here 5)."""
    monkeypatch.setattr(llama, "PROMPT_READ_TIMEOUT", 0.3, raising=False)
    client = LlamaClient(stalled_llama, read_timeout=5)
    messages = [{"role": "system", "content": "s" * 200}, {"role": "user", "content": "hi"}]
    prompt = Prompt(client, ChatCall({"messages": messages}))
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable):
        getattr(prompt, ask)()
    assert time.monotonic() - started < 2
