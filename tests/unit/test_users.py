"""Users are kept apart: client API keys on every client route (401 in each API's shape),
sessions, files, base snapshots and listings scoped per user, anonymous conversations scoped
per client, and the replay attack of issue 22 (a cached-token count confirming a guess of
another user's words) answered with nothing."""
from __future__ import annotations

import os

import pytest
import responses

from kvproxy import create_app
from kvproxy.config import ConfigError, load_settings
from kvproxy.sessions import identity
from kvproxy.upstream.llama import LlamaClient
from kvproxy.web import users
from tests.fake_llama import UPSTREAM, FakeLlama

ALICE, BOB, ADMIN = "alice-key-0123456789", "bob-key-0123456789ab", "admin-token-xyz"
KEYS = {ALICE: "alice", BOB: "bob@example.com"}
SYSTEM = {"role": "system", "content": "You are the bank's assistant. " * 20}
FIRST = {"role": "user", "content": "My card number is 4111 1111 1111 1111."}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def fake(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield FakeLlama(mock, tmp_path)


def make_app(tmp_path, **settings):
    return create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 2,
                       "base_snapshots": False, **settings})


@pytest.fixture
def keyed(tmp_path, fake):
    return make_app(tmp_path, api_keys=dict(KEYS), admin_token=ADMIN)


# -- every client route needs a key, refused in its API's own shape ------------------------
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
REFUSED = [
    ("POST", "/v1/chat/completions", CHAT, "openai"),
    ("POST", "/v1/completions", {"prompt": "hi"}, "openai"),
    ("GET", "/v1/models", None, "openai"),
    ("POST", "/v1/messages", {"model": "m", "max_tokens": 2, **CHAT}, "anthropic"),
    ("POST", "/v1/messages/count_tokens", {"model": "m", **CHAT}, "anthropic"),
    ("POST", "/api/chat", {"model": "tiny", "stream": False, **CHAT}, "ollama"),
    ("POST", "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False}, "ollama"),
    ("GET", "/api/tags", None, "ollama"),
    ("GET", "/api/version", None, "ollama"),
    ("POST", "/completion", {"prompt": "hi"}, "openai"),
    ("POST", "/infill", {"input_prefix": "a", "input_suffix": "b"}, "openai"),
    ("POST", "/v1/responses", {"input": "hi"}, "openai"),
    ("POST", "/tokenize", {"content": "hi"}, "openai"),
    ("GET", "/props", None, "openai"),
    ("POST", "/v1/embeddings", {"input": "hi"}, "openai"),
]


def assert_shape(reply, shape: str) -> None:
    assert reply.status_code == 401, reply.get_data(as_text=True)
    body = reply.get_json()
    if shape == "openai":
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == 401
        assert "API key" in body["error"]["message"]
    elif shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert set(body) == {"error"} and "API key" in body["error"]


@pytest.mark.parametrize("method,path,body,shape", REFUSED)
@pytest.mark.parametrize("sent", [{}, bearer("wrong-key-0123456789"), {"x-api-key": "nope"},
                                  bearer(ADMIN)])
def test_a_client_route_without_a_valid_key_is_a_401_in_its_shape(keyed, fake, method, path,
                                                                   body, shape, sent):
    reply = keyed.test_client().open(path, method=method, json=body, headers=sent)
    assert_shape(reply, shape)
    assert fake.actions == [] and fake.pinned == [], "nothing reached the slot"


@pytest.mark.parametrize("sent", [bearer(ALICE), {"x-api-key": ALICE},
                                  {"Authorization": f"bearer  {ALICE} "}])
def test_a_valid_key_is_taken_as_bearer_or_x_api_key(keyed, sent):
    client = keyed.test_client()
    assert client.post("/v1/chat/completions", json=CHAT, headers=sent).status_code == 200
    assert client.post("/v1/messages", headers=sent,
                       json={"model": "m", "max_tokens": 2, **CHAT}).status_code == 200
    assert client.post("/api/chat", headers=sent,
                       json={"model": "tiny", "stream": False, **CHAT}).status_code == 200


def test_health_metrics_and_the_ollama_probe_need_no_key(keyed):
    client = keyed.test_client()
    for path in ("/health", "/metrics", "/"):
        assert client.get(path).status_code == 200, path


def test_the_admin_token_still_changes_llama_server_settings(keyed, fake):
    fake.mock.add(responses.POST, f"{UPSTREAM}/props", json={"success": True})
    client = keyed.test_client()
    assert client.post("/props", json={}, headers=bearer(ADMIN)).status_code == 200
    assert client.post("/props", json={}, headers=bearer(ALICE)).status_code == 401


def test_keys_are_compared_against_every_key_in_constant_time():
    assert users.user_of(ALICE, KEYS) == "alice"
    assert users.user_of(ALICE[:-1], KEYS) is None
    assert users.user_of(ALICE + "x", KEYS) is None
    assert users.user_of("", KEYS) is None


# -- settings ---------------------------------------------------------------------------
def test_keys_come_from_the_setting_and_a_private_file(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# user key\ncarol carol-key-0123456789\n\n")
    keyfile.chmod(0o600)
    settings = load_settings({"KVPROXY_API_KEYS": f"{ALICE}=alice",
                              "KVPROXY_API_KEYS_FILE": str(keyfile),
                              "KVPROXY_ADMIN_TOKEN": ADMIN})
    assert settings.api_keys == {ALICE: "alice", "carol-key-0123456789": "carol"}
    assert ALICE not in repr(settings)
    keyfile.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_settings({"KVPROXY_API_KEYS_FILE": str(keyfile), "KVPROXY_ADMIN_TOKEN": ADMIN})


@pytest.mark.parametrize("environ,message", [
    ({"KVPROXY_API_KEYS": f"{ALICE}=alice"}, "needs KVPROXY_ADMIN_TOKEN"),
    ({"KVPROXY_API_KEYS": "short=alice", "KVPROXY_ADMIN_TOKEN": ADMIN}, "at least 16"),
    ({"KVPROXY_API_KEYS": f"{ALICE}=alice,{ALICE}=bob", "KVPROXY_ADMIN_TOKEN": ADMIN},
     "also the key"),
    ({"KVPROXY_API_KEYS": f"{ALICE}=a/b", "KVPROXY_ADMIN_TOKEN": ADMIN}, "user name"),
])
def test_bad_key_settings_stop_start_up_without_showing_the_keys(environ, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_settings(environ)
    assert ALICE not in str(caught.value)


# -- per-user scoping -----------------------------------------------------------------------
def chat(client, key, session_id=None, messages=None, **extra):
    headers = {**bearer(key), **({"X-Session-Id": session_id} if session_id else {})}
    reply = client.post("/v1/chat/completions", headers=headers,
                        json={"messages": messages or [SYSTEM, FIRST], **extra})
    assert reply.status_code == 200, reply.get_data(as_text=True)
    return reply


def saved_files(fake) -> set[str]:
    return {name for action, name in fake.actions if action == "save" and name}


def test_the_same_client_id_under_two_keys_is_two_sessions_and_two_files(keyed, fake):
    client = keyed.test_client()
    chat(client, ALICE, "chat-1")
    second = chat(client, BOB, "chat-1")
    assert second.headers["X-KVProxy-Cache"] == "miss", "bob must not get alice's slot"
    assert fake.actions[-1][0] == "erase"
    chat(client, ALICE, "chat-1")  # saves bob's, restores alice's
    assert fake.actions[-1][0] == "restore"
    files = sorted(p.name for p in fake.slot_dir.glob("*.bin"))
    assert len(files) == 2, files
    alice_file = [f for f in files if identity.owns("alice", f[:-4])]
    bob_file = [f for f in files if identity.owns("bob@example.com", f[:-4])]
    assert len(alice_file) == len(bob_file) == 1 and alice_file != bob_file
    assert fake.actions[-1] == ("restore", alice_file[0])


def test_a_user_lists_only_their_sessions_and_the_admin_token_lists_all(keyed, fake):
    client = keyed.test_client()
    chat(client, ALICE, "alice-private")
    chat(client, BOB, "bob-private")
    chat(client, ALICE, "alice-private")  # saves bob's
    chat(client, BOB, "bob-private")      # saves alice's
    def listed(headers):
        reply = client.get("/api/sessions", headers=headers)
        assert reply.status_code == 200, reply.get_data(as_text=True)
        return {s["session_id"] for s in reply.get_json()}
    assert listed(bearer(ALICE)) == {"alice-private"}
    assert listed({"x-api-key": BOB}) == {"bob-private"}
    assert listed(bearer(ADMIN)) == {"alice-private", "bob-private"}
    assert client.get("/api/sessions").status_code == 401
    assert client.get("/api/sessions", headers=bearer("wrong-key-0123456789")).status_code == 401
    # the rest of the admin API stays the operator's
    assert client.get("/api/status", headers=bearer(ALICE)).status_code == 401
    assert client.post("/api/sessions/clear", json={}, headers=bearer(ALICE)).status_code == 401


def test_a_client_id_cannot_name_another_users_key():
    """A key's user comes first in every key, so no id a client sends reaches another's."""
    bob = identity.scoped(identity.Session("chat-1", "body:user", key="client:chat-1"),
                          user="bob")
    forged = identity.scoped(identity.Session(bob.key, "body:user", key="client:" + bob.key),
                             user="alice")
    assert forged.key != bob.key and forged.stem != bob.stem
    assert identity.kind_of_key(bob.key) == "client"


# -- the replay attack of issue 22 --------------------------------------------------------
def replay_attack(app, fake, victim_headers, attacker_headers, path="/v1/chat/completions"):
    """The victim opens with a secret; the attacker replays that first turn and appends a
    guess. The stub answers with as many cached tokens as the slot kvproxy hands it holds:
    what llama-server would reuse is what the slot held, so the count is 0 unless the
    attacker was given the victim's cache."""
    client = app.test_client()
    victim = [SYSTEM, FIRST]
    reply = client.post(path, headers=victim_headers, json={"messages": victim})
    assert reply.status_code == 200
    fake.chat_timings = {"cache_n": 59, "prompt_n": 11, "predicted_n": 2}  # would confirm
    before = list(fake.actions)
    guess = victim + [{"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "And my PIN is 1234."}]
    probe = client.post(path, headers=attacker_headers, json={"messages": guess})
    assert probe.status_code == 200
    swapped = fake.actions[len(before):]
    cached = probe.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    # What the attacker's request ran on: the victim's cache (a hit, or the victim's file or
    # base restored) or an emptied slot.
    got_victims = probe.headers["X-KVProxy-Cache"] in ("hit", "restored", "base")
    return got_victims, cached if got_victims else 0, swapped


def test_the_replay_attack_gets_nothing_across_keys(tmp_path, fake):
    app = make_app(tmp_path, api_keys=dict(KEYS), admin_token=ADMIN, base_snapshots=True)
    fake.slot_token_ids = None
    got, cached, swapped = replay_attack(app, fake, bearer(ALICE), bearer(BOB))
    assert not got and cached == 0, f"bob got alice's cache: {swapped}"
    assert ("erase", None) in swapped
    assert not any(a == "restore" for a, _ in swapped), swapped


def test_the_replay_attack_with_the_victims_id_gets_nothing_across_keys(keyed, fake):
    victim = {**bearer(ALICE), "X-Session-Id": "alice@example.com"}
    attacker = {**bearer(BOB), "X-Session-Id": "alice@example.com"}
    got, cached, swapped = replay_attack(keyed, fake, victim, attacker)
    assert not got and cached == 0, swapped


def test_base_snapshots_are_per_user(tmp_path, fake):
    """A base snapshot of a shared system prompt is the user's own: another user's first
    request does not start from it (its cached count would say someone used that prompt)."""
    app = make_app(tmp_path, api_keys=dict(KEYS), admin_token=ADMIN, base_snapshots=True)
    client = app.test_client()
    first = [SYSTEM, {"role": "user", "content": "one"}]
    fake.mock.add(responses.POST, f"{UPSTREAM}/apply-template", json={"prompt": "S" * 400})
    fake.mock.add(responses.POST, f"{UPSTREAM}/tokenize", json={"tokens": list(range(300))})
    chat(client, ALICE, "a1", messages=first)
    bases = sorted(p.name for p in fake.slot_dir.glob("base.*.bin"))
    assert len(bases) == 1 and identity.owns("alice", bases[0][:-4]), bases
    reply = chat(client, BOB, "b1", messages=first)
    assert reply.headers["X-KVProxy-Cache"] != "base", "bob started from alice's base"
    assert ("restore", bases[0]) not in fake.actions
    assert len(list(fake.slot_dir.glob("base.*.bin"))) == 2
    chat(client, ALICE, "a2", messages=first)
    assert fake.actions[-1] == ("restore", bases[0])  # a user's own base still serves them


# -- without keys: anonymous conversations are the client's ---------------------------------
def test_without_keys_another_address_gets_no_cache_of_an_anonymous_conversation(tmp_path, fake):
    app = make_app(tmp_path)
    victim = {"X-Forwarded-For": "192.0.2.10", "User-Agent": "victim-app/1"}
    for attacker in ({"X-Forwarded-For": "198.51.100.7", "User-Agent": "victim-app/1"},
                     {"X-Forwarded-For": "192.0.2.10", "User-Agent": "curl/8"}):
        got, cached, swapped = replay_attack(app, fake, victim, attacker)
        assert not got and cached == 0, swapped
        fake.chat_timings = {"cache_n": 0, "prompt_n": 10, "predicted_n": 2}


def test_without_keys_the_same_client_keeps_its_anonymous_conversation(tmp_path, fake):
    app = make_app(tmp_path)
    client = app.test_client()
    me = {"X-Forwarded-For": "192.0.2.10", "User-Agent": "app/1"}
    first = client.post("/v1/chat/completions", headers=me, json={"messages": [SYSTEM, FIRST]})
    other = client.post("/v1/chat/completions", headers={**me, "User-Agent": "other/2"},
                        json={"messages": [SYSTEM, FIRST]})
    assert first.headers["X-KVProxy-Session"] != other.headers["X-KVProxy-Session"]
    again = client.post("/v1/chat/completions", headers=me, json={"messages": [SYSTEM, FIRST]})
    assert again.headers["X-KVProxy-Session"] == first.headers["X-KVProxy-Session"]
    assert again.headers["X-KVProxy-Cache"] == "restored"


def test_without_keys_a_named_id_is_shared_by_whoever_sends_it(tmp_path, fake):
    """Documented: without keys an id is a name, not a secret (set keys on a shared server)."""
    app = make_app(tmp_path)
    client = app.test_client()
    client.post("/v1/chat/completions", headers={"X-Forwarded-For": "192.0.2.10"},
                json={"user": "alice@example.com", "messages": [SYSTEM, FIRST]})
    other = client.post("/v1/chat/completions", headers={"X-Forwarded-For": "198.51.100.7"},
                        json={"user": "alice@example.com", "messages": [SYSTEM, FIRST]})
    assert other.headers["X-KVProxy-Cache"] == "hit"


def test_forwarded_addresses_are_believed_only_from_the_trusted_proxies():
    environ = {"REMOTE_ADDR": "127.0.0.1", "HTTP_X_FORWARDED_FOR": "203.0.113.9, 192.0.2.10"}
    default = load_settings({}).forwarded_allow_ips
    assert users.client_address(environ, default) == "192.0.2.10"
    assert users.client_address({**environ, "REMOTE_ADDR": "198.51.100.1"}, default) == "198.51.100.1"
    setting = load_settings({"KVPROXY_FORWARDED_ALLOW_IPS": "127.0.0.1,192.0.2.0/24"})
    assert users.client_address(environ, setting.forwarded_allow_ips) == "203.0.113.9"


def test_side_and_default_sessions_are_scoped_too():
    side = identity.Session(identity.SIDE_SESSION, "side-request", persistent=False)
    one, two = identity.scoped(side, client="a"), identity.scoped(side, client="b")
    assert one.key != two.key and identity.kind_of_key(one.key) == "side"
    assert identity.scoped(side, user="alice").key != identity.scoped(side, user="bob").key


# -- the upstream key -----------------------------------------------------------------------
def test_the_upstream_key_goes_on_every_call(tmp_path, fake):
    app = make_app(tmp_path, upstream_api_key="llama-secret")
    client = app.test_client()
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    fake.mock.add(responses.POST, f"{UPSTREAM}/tokenize", json={"tokens": [1]})
    assert client.post("/tokenize", json={"content": "hi"}).status_code == 200  # relayed
    sent = [call.request for call in fake.mock.calls]
    assert sent and all(r.headers.get("Authorization") == "Bearer llama-secret" for r in sent), \
        [(r.url, r.headers.get("Authorization")) for r in sent]


def test_a_401_from_llama_server_names_the_setting(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.add(responses.GET, f"{UPSTREAM}/props", status=401,
                 json={"error": {"code": 401, "message": "Invalid API Key",
                                 "type": "authentication_error"}})
        from kvproxy.ops.startup import contract_problem
        from tests.fake_llama import make_switch
        problem = contract_problem(LlamaClient(UPSTREAM), make_switch(tmp_path))
    assert "KVPROXY_UPSTREAM_API_KEY" in problem and "401" in problem and "\n" not in problem
