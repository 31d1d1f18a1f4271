"""Many clients at once on the real llama-server: no deadlock, no cross-talk, files intact."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import long_text
from tests.support import stem_of
from kvproxy.storage.store import SessionStore

pytestmark = pytest.mark.real

SESSIONS = {f"team-{i}": long_text(250, seed=300 + i) for i in range(3)}


def chat(url, session, system, history, max_tokens=6, timeout=300):
    reply = requests.post(url + "/v1/chat/completions", timeout=timeout,
                          headers={"X-Session-Id": session},
                          json={"model": "m", "max_tokens": max_tokens, "temperature": 0,
                                "messages": [{"role": "system", "content": system}] + history})
    reply.raise_for_status()
    return reply


def test_eight_threads_over_three_sessions(stack):
    system_tokens = {s: len(requests.post(stack.llama.url + "/tokenize", json={"content": p},
                                          timeout=30).json()["tokens"])
                     for s, p in SESSIONS.items()}
    results = []
    lock = threading.Lock()

    def worker(n):
        session = f"team-{n % 3}"
        history = []
        for turn in range(3):
            history.append({"role": "user", "content": f"Worker {n} question {turn}: rule {turn}?"})
            reply = chat(stack.url, session, SESSIONS[session], history)
            answer = reply.json()
            history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            with lock:
                results.append((session, reply.headers["X-KVProxy-Session"],
                                reply.headers["X-KVProxy-Cache"],
                                answer["usage"]["prompt_tokens_details"]["cached_tokens"]))

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(worker, n) for n in range(8)]
        for future in futures:
            future.result(timeout=500)

    assert len(results) == 24
    assert all(asked == served for asked, served, _, _ in results)
    misses = [r for r in results if r[2] == "miss"]
    assert sorted(r[0] for r in misses) == sorted(SESSIONS), "each session starts empty exactly once"
    for session, _, cache, cached in results:
        if cache != "miss":  # ran on its own session's cache: at least its system prompt reused
            assert cached >= 0.9 * system_tokens[session], (session, cache, cached)

    listing = requests.get(stack.url + "/api/sessions", timeout=10).json()
    saved = [s for s in listing if s["session_id"] in SESSIONS and s.get("saved_at")]
    # every session but the one the slot holds last was swapped out at least once
    assert len({s["session_id"] for s in saved}) >= len(SESSIONS) - 1, listing
    for sidecar in saved:
        stem = stem_of(sidecar["file"])   # whole or as chunks: the file it gives back
        assert SessionStore(stack.slot_dir).bin_bytes(stem) == sidecar["n_bytes"] > 0


def test_disconnect_mid_stream_frees_the_slot(stack):
    body = {"model": "m", "max_tokens": 3000, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    stream = requests.post(stack.url + "/v1/chat/completions", json=body, stream=True, timeout=60,
                           headers={"X-Session-Id": "talker"})
    received = 0
    for line in stream.iter_lines():
        received += line.startswith(b"data:")
        if received == 20:
            break
    assert received == 20
    stream.close()  # the client goes away mid-stream
    gone = time.monotonic()
    reply = chat(stack.url, "listener", "Be brief.", [{"role": "user", "content": "hi"}],
                 max_tokens=2, timeout=60)
    assert reply.headers["X-KVProxy-Session"] == "listener"
    # The 3000 forced tokens would take 40 s or more here; the listener's own turn (a save,
    # a prefill, two tokens) takes well under a second when the machine is idle. The bound
    # leaves room for a loaded machine and still fails if the lost stream runs on.
    assert time.monotonic() - gone < 10.0
    slot = requests.get(stack.llama.url + "/slots", timeout=10).json()[0]
    assert not slot["is_processing"], "llama-server must have stopped generating for the lost client"


def test_waiting_request_gets_503_in_client_format(tmp_path_factory):
    """Covered with a real gunicorn proxy whose lock bound is short."""
    from tests.conftest import Stack
    s = Stack(tmp_path_factory.mktemp("busy"), KVPROXY_LOCK_TIMEOUT="0.5").start()
    try:
        body = {"model": "m", "max_tokens": 400, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Write a long story."}]}
        stream = requests.post(s.url + "/v1/chat/completions", json=body, stream=True, timeout=60,
                               headers={"X-Session-Id": "long"})
        lines = stream.iter_lines()  # keep the iterator: dropping it closes the connection
        next(lines)
        reply = requests.post(s.url + "/v1/chat/completions", timeout=30,
                              headers={"X-Session-Id": "other"},
                              json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        stream.close()
        assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1
        assert "busy" in reply.json()["error"]["message"]
    finally:
        s.stop()
