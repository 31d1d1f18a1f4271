"""Several slots against the real llama-server (-np 2 and -np 3, --slot-prompt-similarity 0,
--cache-ram 0): conversations answer side by side, swaps take the least recently used
slot after saving it, files restore into any slot, and nobody ever runs in another's cache."""
import threading
import time

import pytest
import requests

from tests.conftest import Stack, long_text

pytestmark = pytest.mark.real

LLAMA = {"ctx_size": 4096, "cache_ram_mib": 0}   # 2048 tokens a slot with -np 2


@pytest.fixture(scope="module")
def stack2(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("multislot"), slots=2, llama_args=LLAMA,
              KVPROXY_BASE_SNAPSHOTS="false").start()
    yield s
    s.stop()


def system(seed):
    return long_text(120, seed=seed)  # about 160 tokens: short prefill on a busy machine


def turn(url, session, history, max_tokens=8):
    """One whole turn; the answer joins ``history``. Returns what the reply showed."""
    reply = requests.post(url + "/v1/chat/completions", headers={"X-Session-Id": session},
                          json={"messages": history, "max_tokens": max_tokens, "temperature": 0},
                          timeout=300)
    reply.raise_for_status()
    body = reply.json()
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    usage = body["usage"]
    return {"session": reply.headers["X-KVProxy-Session"], "cache": reply.headers["X-KVProxy-Cache"],
            "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def stream_times(url, session, messages, max_tokens, out, key):
    """Stream one answer; ``out[key]`` gets (first chunk time, last chunk time, headers)."""
    stamps = []
    with requests.post(url + "/v1/chat/completions", headers={"X-Session-Id": session},
                       json={"messages": messages, "max_tokens": max_tokens, "stream": True,
                             "temperature": 0, "ignore_eos": True},
                       stream=True, timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith(b"data: {"):
                stamps.append(time.monotonic())
        out[key] = (stamps[0], stamps[-1], dict(reply.headers), len(stamps))


def slots(url):
    return {s["id"]: s for s in requests.get(url + "/api/slots", timeout=10).json()}


def slot_of(url, session):
    return next(i for i, s in slots(url).items() if s["session_id"] == session)


def sidecar(url, session):
    return next(s for s in requests.get(url + "/api/sessions", timeout=10).json()
                if s["session_id"] == session)


def run_streams(url, sessions, max_tokens):
    out, threads = {}, []
    for name, seed in sessions:
        messages = [{"role": "system", "content": system(seed)},
                    {"role": "user", "content": "Recite the rules one by one."}]
        threads.append(threading.Thread(target=stream_times,
                                        args=(url, name, messages, max_tokens, out, name)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    assert set(out) == {name for name, _ in sessions}, "every stream finished"
    return out


def test_two_conversations_stream_at_the_same_time(stack2):
    out = run_streams(stack2.url, [("par-a", 11), ("par-b", 12)], max_tokens=48)
    (a_first, a_last, a_headers, a_n), (b_first, b_last, b_headers, b_n) = out["par-a"], out["par-b"]
    assert a_headers["X-KVProxy-Session"] == "par-a" and b_headers["X-KVProxy-Session"] == "par-b"
    assert a_n >= 40 and b_n >= 40
    # Each started before the other finished: they ran side by side, not one after the other.
    assert a_first < b_last and b_first < a_last, out
    assert {slot_of(stack2.url, "par-a"), slot_of(stack2.url, "par-b")} == {0, 1}


def test_three_slots_answer_three_conversations_at_once(tmp_path):
    stack = Stack(tmp_path, slots=3, llama_args={"ctx_size": 3072, "cache_ram_mib": 0},
                  KVPROXY_BASE_SNAPSHOTS="false").start()
    try:
        out = run_streams(stack.url, [("tri-a", 21), ("tri-b", 22), ("tri-c", 23)], max_tokens=32)
        latest_start = max(first for first, _, _, _ in out.values())
        earliest_end = min(last for _, last, _, _ in out.values())
        assert latest_start < earliest_end, "all three streamed at the same moment"
        assert sorted(s["session_id"] for s in slots(stack.url).values()) == \
            ["tri-a", "tri-b", "tri-c"]
    finally:
        stack.stop()


def test_a_third_session_takes_the_lru_slot_after_saving_it_and_that_one_comes_back_restored(
        stack2):
    url = stack2.url
    x = [{"role": "system", "content": system(31)}, {"role": "user", "content": "Rule 1?"}]
    y = [{"role": "system", "content": system(32)}, {"role": "user", "content": "Rule 2?"}]
    z = [{"role": "system", "content": system(33)}, {"role": "user", "content": "Rule 3?"}]
    turn(url, "lru-x", x)
    first_y = turn(url, "lru-y", y)
    slot_y = slot_of(url, "lru-y")
    x.append({"role": "user", "content": "And rule 4?"})
    assert turn(url, "lru-x", x)["cache"] == "hit"          # lru-y is now the least recently used
    slot_x = slot_of(url, "lru-x")
    assert slot_x != slot_y
    assert turn(url, "lru-z", z)["cache"] == "miss"
    assert slot_of(url, "lru-z") == slot_y, "the least recently used slot was taken"
    saved = sidecar(url, "lru-y")
    assert saved["n_tokens"] >= first_y["prompt"], "lru-y was saved before its slot was reused"
    y.append({"role": "user", "content": "And rule 5?"})
    back = turn(url, "lru-y", y)
    assert back["session"] == "lru-y" and back["cache"] == "restored"
    # lru-x's slot was now the least recently used: the file saved from one slot was
    # restored into the other and reused there.
    assert slot_of(url, "lru-y") == slot_x != slot_y
    assert back["cached"] >= first_y["prompt"], back
    assert slot_of(url, "lru-z") == slot_y and slots(url)[slot_y]["session_id"] == "lru-z"


def test_a_side_request_runs_while_a_conversation_streams(stack2):
    url = stack2.url
    out = {}
    messages = [{"role": "system", "content": system(41)},
                {"role": "user", "content": "Recite the rules one by one."}]
    streaming = threading.Thread(target=stream_times,
                                 args=(url, "side-conv", messages, 160, out, "conv"))
    streaming.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
            s["session_id"] == "side-conv" and s["busy"] for s in slots(url).values()):
        time.sleep(0.05)
    # OpenWebUI's title request: not streamed, its only user message starts with "### Task:".
    side = requests.post(url + "/v1/chat/completions", json={
        "stream": False, "max_tokens": 4,
        "messages": [{"role": "user", "content": "### Task:\nGenerate a title for the chat."}]},
        timeout=120)
    side_done = time.monotonic()
    streaming.join(240)
    assert side.status_code == 200 and side.headers["X-KVProxy-Session"] == "side"
    first, last, headers, _ = out["conv"]
    assert side_done < last, "the side request did not wait for the whole answer"
    history = messages + [{"role": "user", "content": "Go on."}]
    assert turn(url, "side-conv", history)["cache"] == "hit", "the conversation kept its slot"


def test_no_answer_runs_in_another_sessions_slot_under_concurrent_load(stack2):
    url = stack2.url
    histories = {f"load-{i}": [{"role": "system", "content": system(50 + i)}] for i in range(3)}
    results: dict[str, list] = {name: [] for name in histories}

    def talk(name):
        for n in range(3):
            histories[name].append({"role": "user", "content": f"Rule {n + 1}?"})
            results[name].append(turn(url, name, histories[name]))

    threads = [threading.Thread(target=talk, args=(name,)) for name in histories]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(280)
    for name, turns in results.items():
        assert len(turns) == 3 and all(t["session"] == name for t in turns), turns
        for before, now in zip(turns, turns[1:]):
            assert now["cached"] <= now["prompt"]
            assert now["cache"] in ("hit", "restored"), now
            # Reused tokens come from this session's own history (another session's cache
            # would share only the chat template's first few tokens with this prompt).
            assert now["cached"] >= before["prompt"], (name, turns)


def test_a_restart_of_both_processes_with_two_slots_loses_nothing(stack2):
    url = stack2.url
    histories = {name: [{"role": "system", "content": system(seed)},
                        {"role": "user", "content": "Rule 1?"}]
                 for name, seed in (("keep-a", 61), ("keep-b", 62))}
    for name, history in histories.items():
        turn(url, name, history)
    grown = {}
    for name, history in histories.items():   # newest turns: only the save at shutdown has them
        history.append({"role": "user", "content": "Rule 2?"})
        grown[name] = turn(url, name, history)
        assert grown[name]["cache"] == "hit"
    stack2.stop_proxy()                        # saves the session of every slot
    stack2.llama.restart()
    stack2.start_proxy()
    for name, history in histories.items():
        history.append({"role": "user", "content": "Rule 3?"})
        after = turn(url, name, history)
        assert after["session"] == name and after["cache"] == "restored", after
        assert after["cached"] >= grown[name]["prompt"], (name, grown[name], after)


def test_files_from_another_slot_layout_are_refused_before_llama_server_fails_them(tmp_path):
    """Saved with -np 1 -c 4096, then llama-server runs -np 2 -c 4096 (2048 a slot).
    llama-server fails even a 210-token file from the old layout ("No available space in KV
    cache or invalid slot save file") and wipes the slot, so the slot size stays part of a
    file's fingerprint: both sessions start fresh without a failed restore, and the log and
    their sidecars say why."""
    stack = Stack(tmp_path, slots=1, llama_args=LLAMA, KVPROXY_BASE_SNAPSHOTS="false").start()
    try:
        short = [{"role": "system", "content": system(71)}, {"role": "user", "content": "Rule 1?"}]
        turn(stack.url, "fit-short", short)
        turn(stack.url, "fit-other", [{"role": "system", "content": system(72)},
                                      {"role": "user", "content": "Rule 1?"}])
        stack.stop()
        stack.llama.slots = 2
        stack.start()
        short.append({"role": "user", "content": "Rule 2?"})
        fresh = turn(stack.url, "fit-short", short)
        assert fresh["session"] == "fit-short" and fresh["cache"] == "miss", fresh
        refused = sidecar(stack.url, "fit-short")["refused"]
        assert "'n_ctx': 4096" in refused and "'n_ctx': 2048" in refused, refused
        log = stack.proxy_log()
        assert "not restoring client_fit-short" in log and "restore of" not in log
    finally:
        stack.stop()
