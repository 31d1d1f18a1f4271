"""Admin API on a stubbed llama-server: token, listing, delete, clear."""
from urllib.parse import unquote

import pytest
import responses

from kvproxy import create_app
from kvproxy.sessions.identity import Session, client_key, file_stem, normalise_id
from kvproxy.storage.store import now_iso
from tests.fake_llama import UPSTREAM, FakeLlama, stem_of


@pytest.fixture
def app_and_fake(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                          "admin_token": "s3cret", "base_snapshots": False})
        yield app, fake


def chat(client, session_id):
    return client.post("/v1/chat/completions", headers={"X-Session-Id": session_id},
                       json={"messages": [{"role": "user", "content": "hi"}]})


AUTH = {"Authorization": "Bearer s3cret"}


@pytest.mark.parametrize("method,path", [("get", "/api/sessions"), ("get", "/api/sessions/current"),
                                         ("post", "/api/sessions/clear"),
                                         ("delete", "/api/sessions/x")])
def test_every_admin_call_needs_the_token(app_and_fake, method, path):
    client = app_and_fake[0].test_client()
    assert getattr(client, method)(path).status_code == 401
    assert getattr(client, method)(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    body = {"json": {}} if method == "post" else {}
    assert getattr(client, method)(path, headers=AUTH, **body).status_code in (200, 204, 404)


def test_client_routes_do_not_need_the_admin_token(app_and_fake):
    assert chat(app_and_fake[0].test_client(), "a").status_code == 200


def test_listing_delete_and_clear(app_and_fake, tmp_path):
    app, fake = app_and_fake
    client = app.test_client()
    for session_id in ("a", "b", "a"):
        assert chat(client, session_id).headers["X-KVProxy-Session"] == session_id
    listing = {s["session_id"]: s for s in client.get("/api/sessions", headers=AUTH).get_json()}
    assert set(listing) == {"a", "b"}
    assert listing["b"]["file_bytes"] == (tmp_path / listing["b"]["file"]).stat().st_size > 0
    current = client.get("/api/sessions/current", headers=AUTH).get_json()
    assert current["session_id"] == "a" and current["file_exists"]

    assert client.delete("/api/sessions/a", headers=AUTH).status_code == 204
    assert fake.actions[-1] == ("erase", None), "deleting the active session erases the slot"
    assert not (tmp_path / listing["a"]["file"]).exists()
    assert client.get("/api/sessions/current", headers=AUTH).get_json()["session_id"] == "default"
    assert client.delete("/api/sessions/a", headers=AUTH).status_code == 404

    chat(client, "b")
    assert client.post("/api/sessions/clear", json={}, headers=AUTH).get_json()["session_id"] == "default"
    assert fake.actions[-2:] == [("save", f"{stem_of(client_key('b'))}.saving.bin"), ("erase", None)]
    assert client.get("/api/sessions/current", headers=AUTH).get_json()["session_id"] == "default"


@pytest.mark.parametrize("hostile,shown", [
    ("a\r\nX-Evil: 1", r"a\u000d\u000aX-Evil: 1"), ("日本/語", "%E6%97%A5%E6%9C%AC%2F%E8%AA%9E"),
    ("../../x", "../../x"), ("chat 1", "chat 1"),
    ("100%", "100%25"), ("50%41", "50%2541"),  # a plain id with % would read as an encoded one
])
def test_hostile_body_ids_cannot_break_reply_headers(app_and_fake, hostile, shown):
    """Printable ASCII shown as is; anything else percent-encoded whole, so the header
    always decodes back to the id."""
    app, _ = app_and_fake
    reply = app.test_client().post("/v1/chat/completions", json={
        "session_id": hostile, "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and "X-Evil" not in reply.headers
    from urllib.parse import unquote
    assert reply.headers["X-KVProxy-Session"] == shown
    assert unquote(shown) == normalise_id(hostile)


@pytest.fixture
def two_slots(tmp_path):
    """Two llama-server slots of 4096 tokens each, kvproxy in front (no admin token)."""
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path, n_slots=2, n_ctx=4096)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 2,
                          "base_snapshots": False})
        yield app, fake


def test_api_slots_shows_each_slot_s_session_file_tokens_context_and_times(two_slots):
    app, fake = two_slots
    client = app.test_client()
    switch = app.extensions["kvproxy.switch"]
    before = now_iso()
    assert chat(client, "alice").status_code == 200          # slot 0; slot 1 stays unused
    lease = switch.acquire(Session("alice", "t", key=client_key("alice")))
    try:
        busy_rows = client.get("/api/slots").get_json()
    finally:
        switch.release(lease)
    after = now_iso()
    held = busy_rows[0]
    assert before <= held["since"] <= held["last_used_at"] <= held["busy_since"] <= after, \
        "changed session at the swap, last used by the answer, busy since the request took it"
    unused = {"id": 1, "session_id": "default", "persistent": False, "file": None, "tokens": 0,
              "n_ctx": 4096, "busy": False, "busy_since": None, "unproven": False,
              "since": None, "last_used_at": None}
    assert busy_rows == [
        {"id": 0, "session_id": "alice", "persistent": True,
         "file": f"{stem_of(client_key('alice'))}.bin", "tokens": 12, "n_ctx": 4096,
         "busy": True, "busy_since": held["busy_since"], "unproven": False,
         "since": held["since"], "last_used_at": held["last_used_at"]},
        unused]
    assert client.get("/api/slots").get_json() == [
        {**held, "busy": False, "busy_since": None}, unused], "idle again once released"


def test_a_failed_clear_answers_503_and_leaves_its_slot_free_but_unproven(two_slots):
    """llama-server stops answering /props: a clear cannot swap, whether the slot holds a
    session or nothing yet. Each slot is given back, and not trusted until a good swap."""
    app, fake = two_slots
    client = app.test_client()
    assert chat(client, "alice").status_code == 200          # slot 0
    fake.mock.replace(responses.GET, f"{UPSTREAM}/props", status=500, json={"error": "down"})
    assert client.post("/api/sessions/clear", json={}).status_code == 503        # stops at slot 0
    assert client.post("/api/sessions/clear?slot=1", json={}).status_code == 503
    rows = client.get("/api/slots").get_json()
    assert [(r["session_id"], r["busy"], r["unproven"]) for r in rows] == \
        [("alice", False, True), ("default", False, True)]

    fake.mock.replace(responses.CallbackResponse(
        responses.GET, f"{UPSTREAM}/props", callback=lambda request: fake._json(fake.props)))
    reply = chat(client, "alice")
    assert reply.status_code == 200 and reply.headers["X-KVProxy-Cache"] != "hit", \
        "what the failed clear left in the slot is not served as alice's"
    assert client.post("/api/sessions/clear", json={}).get_json()["slots"] == [0, 1]
    rows = client.get("/api/slots").get_json()
    assert [(r["session_id"], r["busy"], r["unproven"]) for r in rows] == \
        [("default", False, False), ("default", False, False)]
