"""Waiting bounded in count, clients that left, foreign slots, the restore check and deleting
while llama-server is down, against a stubbed llama-server."""
from __future__ import annotations

import socket
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import responses

from kvproxy import create_app
from kvproxy.sessions.identity import Session
from kvproxy.slots.restore_check import judge, slot_file_tokens
from kvproxy.slots.state import SlotTable
from kvproxy.storage.store import SessionStore
from kvproxy.slots.plan import (EMPTY, FOREIGN, OURS, UNKNOWN, judge_slot,
                          too_big)
from kvproxy.slots.switch import HIT, RESTORED, ClientGone, SlotBusy, fingerprint_key
from tests.fake_llama import UPSTREAM, make_switch, MODEL
from tests.fake_llama import FakePrompt
from tests.support import timed_turn as turn, metric, wait_until

A = Session("A", "test", model=MODEL)
B = Session("B", "test", model=MODEL)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


# -- waiting is bounded in count --------------------------------------------------
def test_past_the_waiter_bound_a_request_gets_503_at_once(tmp_path, fake):
    switch = make_switch(tmp_path, lock_timeout=3, max_waiters=2)
    held = switch.acquire(A)
    results = []
    waiters = [threading.Thread(target=lambda: results.append(switch.acquire(B))) for _ in range(2)]
    for thread in waiters:
        thread.start()
    wait_until(lambda: switch.pool.waiting == 2)
    started = time.monotonic()
    with pytest.raises(SlotBusy) as busy:
        switch.acquire(B)
    assert time.monotonic() - started < 2, "refused at once, not after the 3 s time bound"
    assert busy.value.retry_after >= 1 and "too many" in str(busy.value)
    switch.release(held)
    for thread in waiters:
        wait_until(lambda: bool(results))
        switch.release(results.pop())
        thread.join(5)
    assert switch.pool.waiting == 0 and not switch.lock.held_here()


def test_queue_full_is_503_with_retry_after_in_each_api_format(tmp_path, fake):
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "max_waiters": 0,
                      "lock_timeout": 2})
    switch = app.extensions["kvproxy.switch"]
    client = app.test_client()
    lease = switch.acquire(A)
    try:
        openai = client.post("/v1/chat/completions", json=CHAT)
        anthropic = client.post("/v1/messages", json={"model": "m", "max_tokens": 5, **CHAT})
        ollama = client.post("/api/chat", json={"model": "tiny", **CHAT})
    finally:
        switch.release(lease)
    for reply in (openai, anthropic, ollama):
        assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1
    assert openai.json["error"]["message"].startswith("too many requests")
    assert anthropic.json["error"]["type"] == "overloaded_error"
    assert ollama.json["error"].startswith("too many requests")


def test_health_metrics_and_admin_reads_answer_while_every_chat_thread_waits(tmp_path, fake):
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 10,
                      "max_waiters": 8})
    switch = app.extensions["kvproxy.switch"]
    lease = switch.acquire(A)
    chats = [threading.Thread(target=lambda: app.test_client().post(
        "/v1/chat/completions", json=CHAT)) for _ in range(8)]
    for thread in chats:
        thread.start()
    try:
        wait_until(lambda: switch.pool.waiting == 8)
        client = app.test_client()
        for path in ("/health", "/metrics", "/api/sessions", "/api/sessions/current"):
            started = time.monotonic()
            reply = client.get(path)
            assert reply.status_code == 200, path
            assert time.monotonic() - started < 5, f"{path} waited for the slot (10 s)"
        started = time.monotonic()
        assert client.post("/api/sessions/restore-check/reset", json={}).status_code == 200
        assert time.monotonic() - started < 5
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 503
    finally:
        switch.release(lease)
        for thread in chats:
            thread.join(10)


# -- a client that left while waiting costs no swap -------------------------------------
def test_client_that_left_while_waiting_costs_no_swap(tmp_path, fake):
    switch = make_switch(tmp_path, lock_timeout=10)
    turn(switch, A, fake)
    held = switch.acquire(A)
    outcome = []
    server_end, client_end = socket.socketpair()

    def still_wanted():
        readable = server_end.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return readable != b""

    def waiting():
        try:
            outcome.append(switch.acquire(B, still_wanted=still_wanted))
        except ClientGone as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiting)
    thread.start()
    wait_until(lambda: switch.pool.waiting == 1)
    client_end.close()                          # the client gives up
    actions_before = list(fake.actions)
    gone_before = metric("kvproxy_slot_rejected_total", reason="client_gone")
    switch.release(held)
    thread.join(5)
    server_end.close()
    assert isinstance(outcome[0], ClientGone)
    assert metric("kvproxy_slot_rejected_total", reason="client_gone") == gone_before + 1
    assert fake.actions == actions_before, "no save, restore or erase for a client that left"
    assert SessionStore(tmp_path).read_state()["active"] == "A"
    assert not switch.lock.held_here()


def test_client_check_reads_the_gunicorn_socket(tmp_path, fake):
    """The route gives the switch a check built on gunicorn's socket: a closed peer is gone."""
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM})
    server_end, client_end = socket.socketpair()
    from kvproxy.web.common import client_still_there
    with app.test_request_context(environ_base={"gunicorn.socket": server_end}):
        check = client_still_there()
        assert check() is True
        client_end.sendall(b"GET / HTTP/1.1\r\n")   # a pipelined request: still there
        assert check() is True
        client_end.close()
        server_end.recv(100)
        assert check() is False
    server_end.close()


def test_under_gunicorn_a_sent_reply_frees_its_slot_after_close_returns():
    """gunicorn reads a kept-alive connection's next request only once close() returns: the
    closers of a sent reply (recording the answer, freeing the slot) run on another thread,
    and one that waits (asking llama-server) holds up no other reply's; without gunicorn's
    socket (the test client, other servers) they run at once."""
    from kvproxy.web.common import CLOSERS, FreeHeldSlots
    go, ran = threading.Event(), []

    def replying(closer):
        def app(environ, start_response):
            environ.setdefault(CLOSERS, []).append(closer)
            start_response("200 OK", [])
            return [b"ok"]
        return FreeHeldSlots(app)

    def sent(app, environ):
        body = app(environ, lambda *args: None)
        assert list(body) == [b"ok"]
        body.close()

    sent(replying(lambda: ran.append(("slow", go.wait(5), threading.current_thread().name))),
         {"gunicorn.socket": object()})
    assert ran == []                   # close() returned while the closer still waits
    sent(replying(lambda: ran.append(("quick", threading.current_thread().name))),
         {"gunicorn.socket": object()})
    wait_until(lambda: ran)
    assert ran == [("quick", "kvproxy-after-reply")]
    go.set()
    wait_until(lambda: len(ran) == 2)
    assert ran[1] == ("slow", True, "kvproxy-after-reply")
    sent(replying(lambda: ran.append(("plain", threading.current_thread().name))), {})
    assert ran[2] == ("plain", threading.current_thread().name)


def test_reads_wait_for_a_reply_whose_last_byte_was_written_before_close():
    """gunicorn writes a reply's last byte, then asks the body for more, then closes it: a
    client with the whole reply can ask the admin API before close() hands its closers over.
    A reply of known length is waited for from its start; a stream (chunked: its ending is
    written after the body ends) from its end, and not while it is still streaming."""
    from kvproxy.web.common import CLOSERS, FreeHeldSlots, _after_reply
    assert _after_reply.settle(5)

    def replying(headers, chunks):
        def app(environ, start_response):
            environ.setdefault(CLOSERS, []).append(lambda: None)
            start_response("200 OK", headers)
            return iter(chunks)
        return FreeHeldSlots(app)

    whole = replying([("Content-Length", "2")], [b"ok"])({"gunicorn.socket": object()},
                                                          lambda *args: None)
    assert next(whole) == b"ok"                  # written: the client may have it all now
    assert _after_reply.settle(0.05) is False    # ... and a read waits for its record
    assert list(whole) == []
    whole.close()
    assert _after_reply.settle(5) is True

    stream = replying([], [b"a", b"b"])({"gunicorn.socket": object()}, lambda *args: None)
    assert next(stream) == b"a" and next(stream) == b"b"
    assert _after_reply.settle(0) is True        # still streaming: reads do not wait for it
    assert list(stream) == []                    # ended; gunicorn writes the chunked ending
    assert _after_reply.settle(0.05) is False
    stream.close()
    assert _after_reply.settle(5) is True

    plain = replying([("Content-Length", "2")], [b"ok"])({}, lambda *args: None)
    assert list(plain) == [b"ok"] and _after_reply.settle(0) is True   # no gunicorn: at once
    plain.close()


def test_a_stream_counts_as_sent_from_the_event_that_ends_its_answer(tmp_path, fake):
    """openai's Python client stops reading a stream at ``[DONE]``: from llama-server's event
    that ends the answer on, admin reads wait for the stream's release; before it they do not."""
    from werkzeug.test import EnvironBuilder
    from kvproxy.web.common import _after_reply
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False})
    assert _after_reply.settle(5)
    server_end, client_end = socket.socketpair()
    environ = EnvironBuilder(path="/v1/chat/completions", method="POST",
                             json={**CHAT, "stream": True}).get_environ()
    environ["gunicorn.socket"] = server_end
    body = app(environ, lambda *args: None)
    waited = []
    for item in body:
        waited.append((b"finish_reason" in item or b"[DONE]" in item,
                       not _after_reply.settle(0.02)))
    assert [wait for ended, wait in waited if not ended] and not any(
        wait for ended, wait in waited if not ended)           # streaming: reads go on
    assert [wait for ended, wait in waited if ended] and all(
        wait for ended, wait in waited if ended)               # the end is out: reads wait
    body.close()
    assert _after_reply.settle(5) is True
    server_end.close()
    client_end.close()


def test_the_event_that_ends_an_answer():
    from kvproxy.upstream.llama import ends_the_answer
    assert ends_the_answer(None)                                            # [DONE]
    assert ends_the_answer({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    assert ends_the_answer({"choices": [{"text": "", "finish_reason": "length"}]})
    assert ends_the_answer({"content": "", "stop": True})                   # /completion
    assert ends_the_answer({"type": "response.completed", "response": {}})  # Responses API
    assert not ends_the_answer({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]})
    assert not ends_the_answer({"content": "a", "stop": False})
    assert not ends_the_answer({"type": "response.output_text.delta", "delta": "a"})
    assert not ends_the_answer({"choices": "stop"}) and not ends_the_answer("stop")


def test_admin_and_status_reads_wait_for_the_replies_already_sent(tmp_path, fake):
    """A client that lists its sessions or reads the status right after its answer sees that
    answer's record: those reads wait (bounded) for the releases handed over before them;
    chats and health checks do not wait."""
    from kvproxy.web.common import CLOSERS, _after_reply
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False})
    go, done = threading.Event(), {}
    _after_reply.run({CLOSERS: [lambda: go.wait(5)]})   # a sent reply, still being recorded

    def read(path):
        done[path] = app.test_client().get(path).status_code
    readers = [threading.Thread(target=read, args=(path,)) for path in ("/api/sessions", "/metrics")]
    for reader in readers:
        reader.start()
    assert app.test_client().post("/v1/chat/completions", json=CHAT).status_code == 200
    assert app.test_client().get("/health").status_code == 200   # a load balancer's check
    time.sleep(0.3)
    assert done == {}, "the reads waited for the reply before them"
    assert _after_reply.settle(0.05) is False
    go.set()
    for reader in readers:
        reader.join(5)
    assert done == {"/api/sessions": 200, "/metrics": 200}
    assert _after_reply.settle(0) is True


# -- a slot kvproxy cannot vouch for is foreign ----------------------------------------
def test_judge_slot():
    assert judge_slot(None, 10) == UNKNOWN
    assert judge_slot({"id": 0}, 0) == OURS                       # fresh llama-server, nothing expected
    assert judge_slot({"id": 0}, 500) == EMPTY                    # restarted
    assert judge_slot({"id": 0, "id_task": 3, "n_prompt_tokens": 500}, 500) == OURS
    assert judge_slot({"id": 0, "id_task": 3, "n_prompt_tokens": 501}, 500) == OURS
    assert judge_slot({"id": 0, "id_task": 9, "n_prompt_tokens": 37}, 500) == FOREIGN


def test_a_file_is_too_big_only_past_the_slot_context():
    assert too_big(4096, 4096) is None                         # exactly full still fits
    assert "4097 tokens" in too_big(4097, 4096)
    assert too_big(None, 4096) is None and too_big(4097, None) is None  # nothing known to refuse


def test_foreign_content_is_not_saved_over_the_file_and_the_session_is_restored(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)
    turn(switch, A, fake)                       # A restored and answered
    fake.tokens = 37                            # then someone used llama-server directly
    switch.client._witness = None               # as after a kvproxy restart: no open connection
    since = len(fake.actions)
    lease = turn(switch, A, fake)
    assert lease.cache == RESTORED, "the returning session gets its own file back, not a hit"
    assert fake.actions[since:] == [("restore", f"{A.stem}.bin")]
    fake.tokens = 37                            # and again, before the next swap
    since = len(fake.actions)
    turn(switch, B, fake)
    assert fake.actions[since:] == [("restore", f"{B.stem}.bin")], \
        "foreign content is never saved over A's file"


def test_a_client_is_asked_whether_it_is_still_there_only_after_it_waited(tmp_path, fake):
    """The check reads the client's socket: a request that gets its slot at once just runs."""
    switch = make_switch(tmp_path)
    asked = []
    lease = switch.acquire(A, still_wanted=lambda: asked.append(1) or False)
    switch.release(lease)
    assert asked == [] and lease.cache


def test_the_time_each_slot_is_held_is_counted_for_that_slot(tmp_path, fake):
    switch = make_switch(tmp_path, slots=2)
    fake.held.append(0)                         # llama-server with two slots
    fake.props["total_slots"] = 2
    before = [metric("kvproxy_slot_busy_seconds_total", slot=s) for s in ("0", "1")]
    lease = switch.acquire(A)
    time.sleep(0.3)
    switch.release(lease)
    grew = [metric("kvproxy_slot_busy_seconds_total", slot=s) - b
            for s, b in zip(("0", "1"), before)]
    assert 0.3 <= grew[lease.slot] < 10 and grew[1 - lease.slot] == 0, grew


def slot_listings(fake) -> int:
    return sum(1 for call in fake.mock.calls
               if call.request.method == "GET" and call.request.url.endswith("/slots"))


def test_a_hit_over_a_connection_open_since_the_last_slot_call_asks_nothing(tmp_path, fake,
                                                                            monkeypatch):
    """An open connection proves llama-server did not restart: the no-swap path skips /slots."""
    switch = make_switch(tmp_path)
    monkeypatch.setattr(switch.client, "witness", lambda: "the connection of the last slot call")
    monkeypatch.setattr(switch.client, "still_open",
                        lambda witness: witness == "the connection of the last slot call")
    turn(switch, A, fake)
    asked = slot_listings(fake)
    assert turn(switch, A, fake).cache == HIT
    assert slot_listings(fake) == asked


def test_a_swap_never_trusts_the_connection(tmp_path, fake, monkeypatch):
    """Only the session the slot holds may skip /slots: before saving the slot over its file,
    the swap to another session always looks, and foreign content is never saved."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    monkeypatch.setattr(switch.client, "still_open", lambda witness: True)
    fake.tokens = 37                            # someone used llama-server directly
    since = len(fake.actions)
    turn(switch, B, fake)
    assert ("save", f"{A.stem}.bin") not in fake.actions[since:]
    assert not any(name and name.startswith(A.stem) for _, name in fake.actions[since:])


def test_a_slot_recorded_empty_is_not_vouched_for_by_the_connection(tmp_path, fake,
                                                                     monkeypatch):
    """No token count recorded (an answer without timings) proves nothing about the slot:
    /slots is asked, and content someone else left there is not taken for the session."""
    switch = make_switch(tmp_path)
    monkeypatch.setattr(switch.client, "still_open", lambda witness: True)
    switch.release(switch.acquire(A))           # no timings: the slot's count stays 0
    fake.tokens = 25                            # someone used llama-server directly
    assert turn(switch, A, fake).cache != HIT


def test_the_save_at_shutdown_never_trusts_the_connection(tmp_path, fake, monkeypatch):
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    monkeypatch.setattr(switch.client, "still_open", lambda witness: True)
    fake.tokens = 37                            # someone used llama-server directly
    assert switch.checkpoint() is False
    assert ("save", f"{A.stem}.bin") not in fake.actions
    assert not any(name and name.startswith(A.stem) for _, name in fake.actions)


def test_slots_error_means_no_save_and_a_restore(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)
    turn(switch, A, fake)
    fake.mock.replace(responses.GET, f"{UPSTREAM}/slots", status=500, json={"error": "boom"})
    switch.client._witness = None
    since = len(fake.actions)
    assert turn(switch, A, fake).cache == RESTORED
    assert turn(switch, B, fake).cache == RESTORED
    assert fake.actions[since:] == [("restore", f"{A.stem}.bin"), ("restore", f"{B.stem}.bin")], \
        "a slot kvproxy cannot vouch for is never saved"


def test_a_failed_swap_makes_the_slot_untrusted(tmp_path, fake, monkeypatch):
    """The restore of A went through, then recording it in the state file failed: the slot
    holds A while B had the same token count. B must not be served from it."""
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)

    def fails_after_restore(slot, session, tokens):
        raise OSError("disk gone")

    with monkeypatch.context() as patch:
        patch.setattr(switch.executor, "record", fails_after_restore)
        with pytest.raises(Exception):
            switch.acquire(A)
    assert fake.actions[-1] == ("restore", f"{A.stem}.bin")
    other_process = make_switch(tmp_path)      # shares the folder, not this process's memory
    assert other_process.slot_view(SlotTable(SessionStore(tmp_path)).get(0), 0) == UNKNOWN
    since = len(fake.actions)
    lease = turn(switch, B, fake)
    assert lease.cache == RESTORED, "not a hit on what the failed swap left"
    assert fake.actions[since:] == [("restore", f"{B.stem}.bin")], "and nothing saved"
    assert other_process.slot_view(SlotTable(SessionStore(tmp_path)).get(0), 0) != UNKNOWN


def test_an_unexpected_failure_in_a_swap_is_a_503_that_names_it_and_frees_the_slot(
        tmp_path, fake, monkeypatch):
    """A bug on the way (not llama-server's answer, not the disk) reaches the client as a
    retryable 503 pointing at kvproxy's log; an interrupt is not dressed up as one."""
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 1})
    switch = app.extensions["kvproxy.switch"]

    def a_bug(*args, **kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr(switch.fingerprints, "for_swap", a_bug)
    reply = app.test_client().post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1
    assert reply.json["error"]["message"] == \
        "the slot could not be prepared (KeyError); see kvproxy's log"
    assert not switch.lock.held_here()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt()
    monkeypatch.setattr(switch.fingerprints, "for_swap", interrupted)
    with pytest.raises(KeyboardInterrupt):
        switch.acquire(A)
    assert not switch.lock.held_here()


# -- the restore check ------------------------------------------------------------------
def test_judge_counts_only_prompts_that_start_with_the_restored_tokens():
    assert judge(500, 480, None) == "honoured"
    assert judge(500, 0, None) == "not_comparable"      # the cheap check cannot tell
    assert judge(500, 0, 500) == "not_honoured"         # prompt starts with them, none reused
    assert judge(500, 0, 30) == "not_comparable"        # diverges early: a new chat, an edit
    assert judge(500, 20, 100) == "honoured"            # reused most of what it could
    assert judge(40, 0, 40) == "not_comparable"         # too few to judge


def restored_then(switch, fake, session, prompt_tokens, timings):
    lease = switch.acquire(session, prompt=FakePrompt(prompt_tokens))
    assert lease.cache == RESTORED
    switch.release(lease, timings)
    return lease


def two_saved_sessions(switch, fake):
    fake.slot_token_ids = list(range(1000))
    for session in (A, B):
        lease = switch.acquire(session)
        fake.tokens = 500
        switch.release(lease, {"cache_n": 0, "prompt_n": 499, "predicted_n": 1})


def test_diverging_prompts_after_restores_do_not_switch_restoring_off(tmp_path, fake):
    switch = make_switch(tmp_path, restore_miss_limit=2)
    two_saved_sessions(switch, fake)
    key = fingerprint_key(switch.current_made_by())
    for session in (A, B, A, B):          # edited first message: nothing in common after token 10
        fake.tokens = 500
        restored_then(switch, fake, session, list(range(10)) + [7777] * 600,
                      {"cache_n": 10, "prompt_n": 599, "predicted_n": 1})
    assert not switch.restore_check.status(key)["restoring_off"]
    assert switch.restore_check.status(key)["misses_in_a_row"] == 0


def test_restoring_off_expires_and_admin_reset_turns_it_on(tmp_path, fake):
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False,
                      "restore_miss_limit": 1, "restore_off_minutes": 30, "admin_token": "t"})
    switch = app.extensions["kvproxy.switch"]
    two_saved_sessions(switch, fake)
    key = fingerprint_key(switch.current_made_by())
    fake.tokens = 500
    restored_then(switch, fake, A, range(600), {"cache_n": 0, "prompt_n": 600, "predicted_n": 1})
    status = switch.restore_check.status(key)
    assert status["restoring_off"]
    until = datetime.fromisoformat(status["off_until"])
    assert timedelta(minutes=29) < until - datetime.now(timezone.utc) <= timedelta(minutes=30)
    later = datetime.now(timezone.utc) + timedelta(minutes=31)
    assert not switch.restore_check.status(key, now=later)["restoring_off"], "it expires"

    client = app.test_client()
    auth = {"Authorization": "Bearer t"}
    current = client.get("/api/sessions/current", headers=auth).json
    assert current["restore_check"]["restoring_off"] is True and current["restore_check"]["off_until"]
    assert client.post("/api/sessions/restore-check/reset", json={}).status_code == 401
    reset = client.post("/api/sessions/restore-check/reset", json={}, headers=auth)
    assert reset.status_code == 200 and reset.json["restoring_off"] is False
    assert client.get("/api/sessions/current", headers=auth).json["restore_check"]["restoring_off"] is False
    assert switch.acquire(B).cache == RESTORED


def test_slot_file_tokens_reads_both_layouts(tmp_path):
    import struct
    plain = tmp_path / "plain.bin"
    plain.write_bytes(struct.pack("<III3i", 0x67677371, 4, 3, 5, 6, 7) + b"kv")
    packed = tmp_path / "packed.bin"
    packed.write_bytes(struct.pack("<III6i", 0x67677371, 4, 6, -1, 1, 3, 5, 6, 7) + b"kv")
    assert slot_file_tokens(plain) == [5, 6, 7]
    assert slot_file_tokens(packed) == [5, 6, 7]
    (tmp_path / "junk.bin").write_bytes(b"nope")
    assert slot_file_tokens(tmp_path / "junk.bin") is None


# -- deleting the active session while llama-server is down ------------------------------
def test_delete_active_session_while_llama_server_is_down(tmp_path, fake):
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False})
    switch = app.extensions["kvproxy.switch"]
    turn(switch, A, fake)
    turn(switch, B, fake)
    turn(switch, A, fake)
    assert (tmp_path / f"{A.stem}.bin").exists()
    fake.mock.reset()                      # llama-server is gone: every call fails to connect
    reply = app.test_client().delete("/api/sessions/A")
    assert reply.status_code == 204
    assert not (tmp_path / f"{A.stem}.bin").exists() and not (tmp_path / f"{A.stem}.json").exists()
    assert SessionStore(tmp_path).read_state()["active"] == "default"
    assert switch.slot_view(SlotTable(SessionStore(tmp_path)).get(0), 0) == UNKNOWN
    assert switch.slot_listing()[0]["unproven"], "listed as unproven, for every process"


def test_a_slot_holding_a_single_token_is_vouched_for_by_the_connection(tmp_path, fake,
                                                                        monkeypatch):
    """Any recorded content (even one token) is what the open connection vouches for."""
    switch = make_switch(tmp_path)
    monkeypatch.setattr(switch.client, "still_open", lambda witness: True)
    turn(switch, A, fake, {"cache_n": 0, "prompt_n": 1, "predicted_n": 0})
    asked = slot_listings(fake)
    assert turn(switch, A, fake, {"cache_n": 0, "prompt_n": 1, "predicted_n": 0}).cache == HIT
    assert slot_listings(fake) == asked
