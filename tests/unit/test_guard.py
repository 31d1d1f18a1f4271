"""Browsers cannot act for the operator (kvproxy.web.guard): Host names, cross-site requests,
admin content types; and llama-server's slot listing needs the admin token."""
from __future__ import annotations

import pytest

from kvproxy import create_app
from kvproxy.web.guard import cross_site, host_allowed, split_host
from tests.fake_llama import UPSTREAM

CHAT = {"messages": [{"role": "user", "content": "hi"}], "user": "csrf-victim-session"}


@pytest.fixture
def client(fake, tmp_path):
    return create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                       "base_snapshots": False}).test_client()


def sessions(client) -> set[str]:
    return {s["session_id"] for s in client.get("/api/sessions").get_json()}


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1:11434", True), ("localhost:11434", True), ("LOCALHOST.", True),
    ("app.localhost", True), ("[::1]:11434", True), ("10.0.0.12", True),
    ("[fe80::1]", True), ("host.docker.internal:11434", True),
    ("attacker.example:11434", False), ("localhost.attacker.example", False),
    ("127.0.0.1.nip.io", False), ("llm.corp", False),
])
def test_host_names_kvproxy_answers_to(host, allowed):
    assert host_allowed(host, ("host.docker.internal",)) is allowed


def test_configured_host_names():
    assert host_allowed("llm.corp:80", ("llm.corp",))
    assert host_allowed("a.b.example.com", (".example.com",))
    assert host_allowed("example.com", (".example.com",))
    assert not host_allowed("badexample.com", (".example.com",))
    assert host_allowed("anything", ("*",))
    assert split_host("[::1]:8080") == ("::1", 8080) and split_host("Name.") == ("name", None)


@pytest.mark.parametrize("headers, host, refused", [
    ({}, "127.0.0.1:11434", False),                                       # curl, SDKs, servers
    ({"Sec-Fetch-Site": "same-origin", "Origin": "http://127.0.0.1:11434"}, "127.0.0.1:11434", False),
    ({"Sec-Fetch-Site": "none"}, "127.0.0.1:11434", False),               # typed in the address bar
    ({"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"}, "127.0.0.1:11434", True),
    ({"Sec-Fetch-Site": "same-site", "Origin": "http://localhost:3000"}, "localhost:11434", True),
    ({"Sec-Fetch-Site": "cross-site"}, "127.0.0.1:11434", True),
    ({"Origin": "http://127.0.0.1:11434"}, "127.0.0.1:11434", False),      # no Sec-Fetch-Site
    ({"Origin": "http://127.0.0.1:8080"}, "127.0.0.1", False),             # nginx's $host: no port
    ({"Origin": "http://evil.example"}, "127.0.0.1:11434", True),
    ({"Origin": "http://127.0.0.1:3000"}, "127.0.0.1:11434", True),
    ({"Origin": "null"}, "127.0.0.1:11434", True),
])
def test_which_requests_come_from_another_site(headers, host, refused):
    assert bool(cross_site(headers, host, ())) is refused


def test_an_allowed_origin_may_send():
    headers = {"Sec-Fetch-Site": "cross-site", "Origin": "https://chat.example.com"}
    assert cross_site(headers, "127.0.0.1", ("https://chat.example.com/",)) is None
    assert cross_site(headers, "127.0.0.1", ("*",)) is None
    assert cross_site(headers, "127.0.0.1", ("https://other.example.com",))


CROSS = {"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"}


def test_cross_site_admin_and_chat_requests_are_refused_in_their_family_shape(client):
    form = client.post("/api/sessions/clear", headers=CROSS, data={"x": "1"})
    assert form.status_code == 403 and "KVPROXY_ALLOWED_ORIGINS" in form.get_json()["message"]
    reset = client.post("/api/sessions/restore-check/reset", headers=CROSS)
    assert reset.status_code == 403
    assert client.get("/api/sessions", headers=CROSS).status_code == 403
    chat = client.post("/v1/chat/completions", headers=CROSS, data=str(CHAT).replace("'", '"'),
                       content_type="text/plain")
    assert chat.status_code == 403 and "evil.example" in chat.get_json()["error"]["message"]
    ollama = client.post("/api/chat", headers=CROSS, json=CHAT)
    assert ollama.status_code == 403 and "KVPROXY_ALLOWED_ORIGINS" in ollama.get_json()["error"]
    anthropic = client.post("/v1/messages", headers=CROSS, json=CHAT)
    assert anthropic.status_code == 403 and anthropic.get_json()["type"] == "error"
    assert "csrf-victim-session" not in sessions(client)
    # Reading what a page can read anyway stays open: the status page, the model list.
    assert client.get("/status", headers=CROSS).status_code == 200
    assert client.get("/v1/models", headers=CROSS).status_code == 200


def test_same_origin_and_non_browser_requests_go_through(client):
    same = {"Sec-Fetch-Site": "same-origin", "Origin": "http://localhost"}
    assert client.post("/api/sessions/clear", headers=same, json={}).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert "csrf-victim-session" in sessions(client)


def test_admin_posts_must_be_json(client):
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        reply = client.post("/api/sessions/clear", data="{}", content_type=kind)
        assert reply.status_code == 415, kind
        assert reply.get_json()["message"] == \
            "POST /api/sessions/clear needs 'Content-Type: application/json'"
    assert client.post("/api/sessions/restore-check/reset", json={}).status_code == 200


def test_an_admin_post_with_no_body_and_no_type_is_what_curl_sends_and_works(client):
    """``curl -X POST .../api/sessions/clear``: the original design's call, no body."""
    for path in ("/api/sessions/clear", "/api/sessions/restore-check/reset"):
        reply = client.post(path)
        assert reply.status_code == 200, (path, reply.get_data(as_text=True))
    assert client.post("/api/sessions/clear").get_json()["cleared"] is True
    # A page on another site sending the same empty POST names itself, and is refused.
    for page in (CROSS, {"Origin": "http://attacker.example"}):
        assert client.post("/api/sessions/clear", headers=page).status_code == 403
    # A body, or a content type, still needs JSON.
    assert client.post("/api/sessions/clear", data="", content_type="text/plain").status_code == 415


def test_a_foreign_host_name_is_refused(client):
    """DNS rebinding: a page on attacker.example whose name now points at kvproxy."""
    refused = client.get("/api/sessions", headers={"Host": "attacker.example:11434"})
    assert refused.status_code == 403
    assert refused.get_json()["message"] == ("kvproxy does not answer to the host name "
                                             "'attacker.example:11434': add it to KVPROXY_ALLOWED_HOSTS")
    chat = client.post("/v1/chat/completions", json=CHAT, headers={"Host": "attacker.example"})
    assert chat.status_code == 403 and "error" in chat.get_json()
    assert client.get("/api/sessions", headers={"Host": "127.0.0.1:11434"}).status_code == 200


def test_configured_names_and_origins(fake, tmp_path):
    client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                         "allowed_hosts": ("llm.corp",),
                         "allowed_origins": ("https://chat.corp",)}).test_client()
    assert client.get("/api/sessions", headers={"Host": "llm.corp"}).status_code == 200
    assert client.get("/api/sessions", headers={"Host": "host.docker.internal"}).status_code == 403
    page = {"Sec-Fetch-Site": "same-site", "Origin": "https://chat.corp"}
    assert client.post("/v1/chat/completions", json=CHAT, headers=page).status_code == 200


def test_the_slot_listing_needs_the_admin_token(fake, tmp_path):
    client = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                         "admin_token": "s3cret"}).test_client()
    for method in ("get", "head"):
        refused = getattr(client, method)("/slots")
        assert refused.status_code == 401, method
    assert "admin token" in client.get("/slots").get_json()["error"]["message"]
    assert client.get("/slots", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/props").status_code == 200, "the rest stays open"


def test_without_a_token_the_slot_listing_stays_open(client):
    assert client.get("/slots").status_code == 200
