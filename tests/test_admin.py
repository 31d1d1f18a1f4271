"""Admin API on a stubbed llama-server: token, listing, delete, clear."""
from urllib.parse import unquote

import pytest
import responses

from kvproxy import create_app
from kvproxy.identity import Session
from tests.fake_llama import UPSTREAM, FakeLlama


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
    assert getattr(client, method)(path, headers=AUTH).status_code in (200, 204, 404)


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
    assert client.post("/api/sessions/clear", headers=AUTH).get_json()["session_id"] == "default"
    assert fake.actions[-2:] == [("save", f"{Session('b', 't').stem}.bin"), ("erase", None)]
    assert client.get("/api/sessions/current", headers=AUTH).get_json()["session_id"] == "default"


@pytest.mark.parametrize("hostile,shown", [
    ("a\r\nX-Evil: 1", "a%0D%0AX-Evil%3A%201"), ("日本/語", "%E6%97%A5%E6%9C%AC%2F%E8%AA%9E"),
    ("../../x", "../../x"), ("chat 1", "chat 1"),
    ("100%", "100%25"),  # a plain id with % would read as an encoded one
])
def test_hostile_body_ids_cannot_break_reply_headers(app_and_fake, hostile, shown):
    app, _ = app_and_fake
    reply = app.test_client().post("/v1/chat/completions", json={
        "session_id": hostile, "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and "X-Evil" not in reply.headers
    assert reply.headers["X-KVProxy-Session"] == shown
    assert unquote(shown) == hostile
