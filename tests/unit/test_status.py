"""The status page and its data (GET /status, GET /api/status) on a stubbed llama-server."""
import json
import re
import time
from pathlib import Path

import pytest
import responses

from kvproxy import create_app
from kvproxy.telemetry.activity import RecentActivity
from kvproxy.sessions.identity import Session, client_key
from kvproxy.ops.status import restore_check_view, session_rows
from kvproxy.storage.store import SIDECAR_FORMAT
from kvproxy.slots.switch import fingerprint, fingerprint_key
from tests.fake_llama import MODELS, PROPS, UPSTREAM, FakeLlama, MODEL

AUTH = {"Authorization": "Bearer s3cret"}
STATIC = Path(__file__).resolve().parents[2] / "kvproxy" / "static"


@pytest.fixture
def fake_app(tmp_path):
    def build(**settings):
        mock = responses.RequestsMock(assert_all_requests_are_fired=False)
        mock.start()
        built.append(mock)
        fake = FakeLlama(mock, tmp_path)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                          "base_snapshots": False, **settings})
        return app, fake
    built = []
    yield build
    for mock in reversed(built):   # last started, first stopped: each restores the one before
        mock.stop()
        mock.reset()


def chat(client, session_id):
    return client.post("/v1/chat/completions", headers={"X-Session-Id": session_id},
                       json={"messages": [{"role": "user", "content": "hi"}]})


def test_status_shows_slot_sessions_outcomes_swaps_disk_and_llama(fake_app, tmp_path):
    app, fake = fake_app(max_disk_gb=2)
    client = app.test_client()
    fake.chat_timings = {"cache_n": 0, "prompt_n": 40, "predicted_n": 2}
    chat(client, "alice")
    chat(client, "bob")
    fake.chat_timings = {"cache_n": 30, "prompt_n": 5, "predicted_n": 2}
    chat(client, "alice")   # restored from its file
    chat(client, "alice")   # the slot holds it: a hit
    data = client.get("/api/status").get_json()

    assert data["slots"] == [{**data["slots"][0], "id": 0, "session_id": "alice",
                              "persistent": True, "busy": False}]
    assert data["slots"][0]["file"] == f"{Session('alice', 't', key=client_key('alice'), model=MODEL).stem}.bin"
    assert data["slots"][0]["tokens"] == 37 and data["slots"][0]["n_ctx"] == 8192

    rows = {r["id"]: r for r in data["sessions"]}
    assert set(rows) == {"alice", "bob"}
    assert rows["alice"]["hits"] == 3 and rows["alice"]["restores"] == 1
    assert rows["alice"]["last_cache"] == "hit" and rows["bob"]["last_cache"] == "miss"
    assert rows["bob"]["bytes"] == (tmp_path / rows["bob"]["file"]).stat().st_size > 0
    assert data["sessions"][0]["id"] == "alice", "most recently used first"

    stats = data["stats"]
    assert stats["outcomes"] == {"hit": 1, "restored": 1, "base": 0, "miss": 2}
    assert stats["requests"] == 4 and stats["hit_ratio"] == 0.5
    assert stats["tokens"] == {"reused": 60, "computed": 90}
    assert sum(b["miss"] for b in data["timeline"]) == 2
    assert sum(b["reused"] for b in data["timeline"]) == 60

    swaps = data["swaps"]
    assert [(s["session_id"], s["cache"]) for s in swaps] == [
        ("alice", "restored"), ("bob", "miss"), ("alice", "miss")], "newest first, hits are no swap"
    assert all(s["ms"] >= 0 for s in swaps) and swaps[0]["restored_tokens"] == 42

    disk = data["disk"]
    assert disk["bound_bytes"] == 2 * 1024**3 and disk["files"] == 2
    assert disk["used_bytes"] == sum(r["bytes"] for r in data["sessions"])
    assert 0 < disk["free_bytes"] <= disk["total_bytes"]

    llama = data["llama_server"]
    assert llama["status"] == "ok" and llama["model"] == "tiny.gguf" and llama["build"] == "b1-test"
    assert data["restore_check"]["restoring_off"] is False
    assert data["restore_check"]["reset"] == "/api/sessions/restore-check/reset"


def test_every_slot_is_a_row_with_its_own_session_and_state_and_swaps_name_their_slot(
        fake_app, tmp_path):
    mock = responses.RequestsMock(assert_all_requests_are_fired=False)
    mock.start()
    try:
        fake = FakeLlama(mock, tmp_path, n_slots=2)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                          "base_snapshots": False})
        client = app.test_client()
        chat(client, "alice")
        chat(client, "bob")       # slot 0 holds alice: bob takes the empty slot 1
        switch = app.extensions["kvproxy.switch"]
        lease = switch.acquire(Session("bob", "t", key=client_key("bob")))
        try:
            data = client.get("/api/status").get_json()
        finally:
            switch.release(lease)
    finally:
        mock.stop()
        mock.reset()
    held = {s["session_id"]: s for s in data["slots"]}
    assert [s["id"] for s in data["slots"]] == [0, 1] and set(held) == {"alice", "bob"}
    assert held["bob"]["id"] == lease.slot != held["alice"]["id"]
    assert held["bob"]["busy"] is True and held["alice"]["busy"] is False
    assert all(s["n_ctx"] == fake.n_ctx for s in data["slots"])
    assert sorted((s["session_id"], s["slot"]) for s in data["swaps"]) == [
        ("alice", held["alice"]["id"]), ("bob", held["bob"]["id"])]


def test_busy_while_a_request_holds_the_slot(fake_app):
    app, _ = fake_app()
    switch = app.extensions["kvproxy.switch"]
    lease = switch.acquire(Session("carol", "t", model=MODEL))
    try:
        assert app.test_client().get("/api/status").get_json()["slots"][0]["busy"] is True
    finally:
        switch.release(lease)
    assert app.test_client().get("/api/status").get_json()["slots"][0]["busy"] is False


def test_base_snapshots_are_listed_apart(fake_app):
    app, fake = fake_app(base_snapshots=True)
    # A base snapshot is the system prompt alone, templated and tokenized by llama-server
    # (one token per character here); only a system prompt of 32 tokens or more gets one.
    system = "Answer briefly and in plain words, please. " * 2
    fake.mock.add_callback(responses.POST, f"{UPSTREAM}/apply-template", callback=lambda r: (
        200, {}, json.dumps({"prompt": "".join(m["content"] for m in json.loads(r.body)["messages"])})))
    fake.mock.add_callback(responses.POST, f"{UPSTREAM}/tokenize", callback=lambda r: (
        200, {}, json.dumps({"tokens": [ord(c) for c in json.loads(r.body)["content"]]})))
    client = app.test_client()
    client.post("/v1/chat/completions", json={"session_id": "dave", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hi"}]})
    assert fake.prefills == [[ord(c) for c in system]]
    data = client.get("/api/status").get_json()
    assert [r["id"] for r in data["sessions"]] == ["dave"]
    assert len(data["bases"]) == 1 and data["bases"][0]["system_hash"]


def test_data_needs_the_token_but_the_page_does_not(fake_app):
    app, _ = fake_app(admin_token="s3cret")
    client = app.test_client()
    refused = client.get("/api/status")
    assert refused.status_code == 401 and "admin token" in refused.get_json()["message"]
    assert client.get("/api/status", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/api/status", headers=AUTH).status_code == 200
    page = client.get("/status")
    assert page.status_code == 200 and page.mimetype == "text/html"
    assert 'data-token-required="true"' in page.get_data(as_text=True)
    assert "s3cret" not in page.get_data(as_text=True)


def test_page_says_when_no_token_is_needed(fake_app):
    app, _ = fake_app()
    assert 'data-token-required="false"' in app.test_client().get("/status").get_data(as_text=True)


def test_page_loads_nothing_from_elsewhere(fake_app):
    app, _ = fake_app()
    client = app.test_client()
    page = client.get("/status")
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    html = page.get_data(as_text=True)
    assert not re.search(r"<script>|\sstyle=|\son\w+=", html), "no inline code: the CSP forbids it"
    for asset in re.findall(r'(?:src|href)="(static/[^"]+)"', html):
        served = client.get("/" + asset)
        assert served.status_code == 200, asset
        assert not re.search(rb"https?://", served.data), f"{asset} names another origin"
    assert not re.search(r"(?:src|href)=\"(?:https?:)?//", html)


def test_polling_does_not_fill_the_log(fake_app, caplog):
    app, _ = fake_app()
    with caplog.at_level("INFO", logger="kvproxy.requests"):
        app.test_client().get("/api/status")
        app.test_client().get("/status")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvproxy.requests"]
    assert len(lines) == 1 and "route=/status " in lines[0], "the page load is logged, its polls not"


def test_sessions_can_be_left_out(fake_app):
    app, _ = fake_app()
    client = app.test_client()
    chat(client, "erin")
    data = client.get("/api/status?sessions=0").get_json()
    assert data["sessions"] is None and data["slots"][0]["session_id"] == "erin"


def test_llama_server_down_still_answers(tmp_path):
    app = create_app({"slot_dir": str(tmp_path), "upstream": "http://127.0.0.1:9",
                      "connect_timeout": 1})
    with responses.RequestsMock() as mock:
        mock.add_passthru("http://127.0.0.1:9")
        data = app.test_client().get("/api/status").get_json()
    assert data["llama_server"]["status"] == "unreachable"
    assert data["slots"][0]["session_id"] == "default" and data["restore_check"]["restoring_off"] is None


def test_llama_server_loading_is_shown(fake_app):
    app, fake = fake_app()
    fake.mock.replace(responses.GET, f"{UPSTREAM}/health", status=503,
                      json={"error": {"code": 503, "message": "Loading model"}})
    llama = app.test_client().get("/api/status").get_json()["llama_server"]
    assert llama["status"] == "unhealthy" and llama["error"] == "Loading model"


def test_restore_check_state_for_the_running_model(fake_app):
    """The page shows the switch's restore check (its own file), for the running model."""
    app, _ = fake_app(restore_miss_limit=2)
    key = fingerprint_key(fingerprint(PROPS, MODELS))
    check = app.extensions["kvproxy.switch"].restore_check
    check.record(key, honoured=False)
    view = app.test_client().get("/api/status").get_json()["restore_check"]
    assert view["restoring_off"] is False and view["misses_in_a_row"] == 1 and view["limit"] == 2
    assert view["models_off"] == 0
    check.record("other", honoured=False)
    check.record("other", honoured=False)        # another model switched off
    view = app.test_client().get("/api/status").get_json()["restore_check"]
    assert view["restoring_off"] is False and view["models_off"] == 1
    assert check.record(key, honoured=False) == (2, True)
    view = app.test_client().get("/api/status").get_json()["restore_check"]
    assert view["restoring_off"] is True and view["models_off"] == 2
    assert view["off_since"] == check.status(key)["off_since"] and view["off_until"]
    check.reset()
    view = app.test_client().get("/api/status").get_json()["restore_check"]
    assert view["restoring_off"] is False and view["models_off"] == 0


def test_restore_check_view_for_another_model_only():
    entries = {"other": {"off_since": "2026-01-01T00:00:00+00:00",
                         "off_until": "2999-01-01T00:00:00+00:00"},
               "expired": {"off_since": "2026-01-01T00:00:00+00:00",
                           "off_until": "2026-01-01T01:00:00+00:00", "misses": 1}}
    view = restore_check_view(entries, 2, running_key="mine")
    assert view["restoring_off"] is False and view["models_off"] == 1
    assert view["misses_in_a_row"] == 0
    view = restore_check_view(entries, 2, running_key="expired")
    assert view["restoring_off"] is False and view["misses_in_a_row"] == 1
    assert restore_check_view(entries, 2, running_key="other")["restoring_off"] is True


def test_session_rows_split_and_sort():
    sessions, bases = session_rows([
        {"session_id": "a", "stem": "a-1", "kind": "session", "last_used_at": "2026-01-01", "hits": 2},
        {"session_id": "b", "stem": "b-1", "kind": "session", "last_used_at": "2026-03-01",
         "refused": "made by another model"},
        {"session_id": "base:x", "stem": "base.x", "kind": "base", "saved_at": "2026-02-01",
         "system_hash": "x"}])
    assert [r["id"] for r in sessions] == ["b", "a"] and sessions[0]["refused"] is True
    assert bases == [{"id": "base:x", "file": "base.x.bin", "bytes": 0, "tokens": None,
                      "last_used": "2026-02-01", "restores": 0, "system_hash": "x"}]


def test_activity_buffers_are_bounded_and_bucketed():
    now = [1_000_000.0]
    activity = RecentActivity(max_swaps=3, max_requests=5, clock=lambda: now[0])
    for i in range(10):
        activity.record_swap(f"s{i}", "miss", 1.0, 0)
        activity.record_request("miss" if i % 2 else "hit", 10, 1)
        now[0] += 30
    assert [s["session_id"] for s in activity.recent_swaps()] == ["s9", "s8", "s7"]
    assert len(activity.requests) == 5
    totals = activity.totals()
    assert totals["requests"] == 10 and totals["outcomes"]["hit"] == 5 and totals["hit_ratio"] == 0.5
    timeline = activity.timeline(minutes=30)
    assert len(timeline) == 30
    assert sum(b["hit"] + b["miss"] for b in timeline) == 5, "only what the ring buffer still holds"
    assert [b["reused"] for b in timeline[-3:]] == [20, 20, 10]


def test_data_with_a_thousand_sessions(fake_app, tmp_path):
    """Prints how long /api/status takes with 1,000 sidecars (a figure, not a timed assertion)."""
    app, _ = fake_app(admin_token="s3cret")
    for i in range(1000):
        stem = f"user-{i:04d}-{i:016x}"
        (tmp_path / f"{stem}.bin").write_bytes(b"x" * 100)
        (tmp_path / f"{stem}.json").write_text(json.dumps({
            "format": SIDECAR_FORMAT, "stem": stem, "session_id": f"user-{i:04d}@example.org",
            "kind": "session", "n_tokens": 1000 + i, "hits": i % 7, "restores": i % 3,
            "last_used_at": f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}+00:00",
            "last_cache": "restored", "made_by": {"model_path": "/m.gguf"}}))
    client = app.test_client()
    client.get("/api/status", headers=AUTH)  # warm the file cache
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        response = client.get("/api/status", headers=AUTH)
        timings.append((time.perf_counter() - started) * 1000)
    data = response.get_json()
    assert len(data["sessions"]) == 1000 and data["disk"]["files"] == 1000
    assert data["sessions"][0]["id"] == "user-0999@example.org"
    print(f"\nGET /api/status with 1,000 saved sessions: median {sorted(timings)[2]:.1f} ms, "
          f"{len(response.data) / 1024:.0f} KiB of JSON")


def test_static_page_weight_is_small():
    weight = sum(p.stat().st_size for p in STATIC.glob("status.*"))
    print(f"\nstatus page assets: {weight / 1024:.1f} KiB (CSS and JS, uncompressed)")
    assert weight < 64 * 1024, "the page is meant to stay small: no bundled libraries"


def test_status_shows_the_shared_store_when_it_is_on(fake_app, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "status-secret-0123456789")
    app, _ = fake_app()
    assert app.test_client().get("/api/status").get_json()["store"] is None
    app, _ = fake_app(store_url="s3://kv-store/p")
    response = app.test_client().get("/api/status")
    store = response.get_json()["store"]
    assert store["url"] == "s3://kv-store/p" and store["waiting"] == 0 and store["problem"] is None
    assert {"uploaded", "uploaded_bytes", "dropped", "fetched", "fetch_failures"} <= set(store)
    assert "status-secret-0123456789" not in response.get_data(as_text=True)
