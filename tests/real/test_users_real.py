"""Users are kept apart, with the real ``openai`` and ``anthropic`` clients, kvproxy under
gunicorn and a real llama-server started with ``--api-key`` (fronted through
``KVPROXY_UPSTREAM_API_KEY``): two users sending the same session id get two sessions and
two files, and one replaying the other's first turn with a guess appended gets no cached
token of the other's conversation."""
from __future__ import annotations

import anthropic
import openai
import pytest
import requests

from conftest import Stack
from kvproxy.launch.processes import ProxyServer
from kvproxy.sessions import identity
from tests.support import saved_stems

pytestmark = pytest.mark.real

ALICE, BOB, ADMIN = "alice-key-0123456789", "bob-key-0123456789ab", "admin-token-real"
UPSTREAM_KEY = "llama-server-key-42"
SYSTEM = "You are a bank's helpful assistant. Answer in one short sentence."
SECRET = "My card number is 4111 1111 1111 1111 and I need a new one."
GUESS = "My PIN is 1234, is that safe to keep?"
SESSION = "shared-session-id"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("users")
    s = Stack(tmp, llama_args={"extra_args": ["--api-key", UPSTREAM_KEY], "cache_ram_mib": 0},
              KVPROXY_API_KEYS=f"{ALICE}=alice,{BOB}=bob",
              KVPROXY_ADMIN_TOKEN=ADMIN, KVPROXY_UPSTREAM_API_KEY=UPSTREAM_KEY).start()
    yield s
    s.stop()


def oai(stack, key):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=120)


def ant(stack, key):
    return anthropic.Anthropic(base_url=stack.url, api_key=key, max_retries=0, timeout=120)


def alice_turn(stack, messages):
    raw = oai(stack, ALICE).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "system", "content": SYSTEM}, *messages], max_tokens=8,
        temperature=0, extra_headers={"X-Session-Id": SESSION})
    return raw, raw.parse()


def test_llama_server_wants_its_key_and_kvproxy_sends_it(stack):
    direct = requests.post(stack.llama.url + "/tokenize", json={"content": "hi"}, timeout=30)
    assert direct.status_code == 401
    relayed = requests.post(stack.url + "/tokenize", json={"content": "hi"}, timeout=30,
                            headers={"Authorization": f"Bearer {ALICE}"})
    assert relayed.status_code == 200 and relayed.json()["tokens"]


def test_no_key_or_a_wrong_one_is_refused_by_each_client(stack):
    with pytest.raises(openai.AuthenticationError):
        oai(stack, "wrong-key-0123456789").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(anthropic.AuthenticationError):
        ant(stack, "wrong-key-0123456789").messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert requests.get(stack.url + "/health", timeout=30).status_code == 200


def test_two_users_with_one_session_id_are_two_sessions_and_share_no_cache(stack):
    raw, first = alice_turn(stack, [{"role": "user", "content": SECRET}])
    assert raw.headers["x-kvproxy-session"] == SESSION
    answer = first.choices[0].message.content
    replay = [{"role": "user", "content": SECRET}, {"role": "assistant", "content": answer},
              {"role": "user", "content": GUESS}]
    # Bob replays alice's first turn with a guess appended, through the Anthropic API
    attack = ant(stack, BOB).messages.with_raw_response.create(
        model="m", system=SYSTEM, max_tokens=4, messages=replay,
        extra_headers={"X-Session-Id": SESSION}, extra_body={"temperature": 0})
    usage = attack.parse().usage
    assert attack.headers["x-kvproxy-session"] == SESSION
    assert attack.headers["x-kvproxy-cache"] == "miss"
    assert usage.cache_read_input_tokens == 0, "bob's count reflects alice's text"
    # and again through the OpenAI API, now that bob's own session holds the slot
    again = oai(stack, BOB).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "system", "content": SYSTEM}, *replay[:1]], max_tokens=2,
        temperature=0, extra_headers={"X-Session-Id": SESSION})
    # bob's own session (his replay) may be reused, never alice's: it started empty above
    bob_cached = again.parse().usage.prompt_tokens_details.cached_tokens
    # Alice comes back: her own file, her own cache
    raw, back = alice_turn(stack, replay)
    assert raw.headers["x-kvproxy-cache"] == "restored"
    alice_cached = back.usage.prompt_tokens_details.cached_tokens
    assert alice_cached > 20, "the same replay under alice's key reuses her conversation"
    print(f"replay figures: bob (attacker) cached 0 of {usage.input_tokens} on /v1/messages, "
          f"{bob_cached} of his own on /v1/chat/completions; alice (owner) cached {alice_cached}"
          f" of {back.usage.prompt_tokens}")
    # two files, one per user; each user lists only theirs, the admin token both
    files = sorted(s for s in saved_stems(stack.slot_dir) if not s.startswith("base."))
    assert sum(identity.owns("alice", f) for f in files) == 1, files
    assert sum(identity.owns("bob", f) for f in files) == 1, files

    def listed(key):
        reply = requests.get(stack.url + "/api/sessions", timeout=30,
                             headers={"Authorization": f"Bearer {key}"})
        assert reply.status_code == 200, reply.text
        return [(s["session_id"], s["file"]) for s in reply.json() if s["kind"] == "session"]
    mine, theirs, everyone = listed(ALICE), listed(BOB), listed(ADMIN)
    assert [s for s, _ in mine] == [SESSION] and [s for s, _ in theirs] == [SESSION]
    assert mine[0][1] != theirs[0][1] and sorted(everyone) == sorted(mine + theirs)


def test_without_the_upstream_key_start_up_names_the_setting(stack, tmp_path):
    proxy = ProxyServer(stack.llama.url, str(tmp_path / "slots"), log_path=str(tmp_path / "p.log"),
                        env={"KVPROXY_LOCK_TIMEOUT": "30"})
    with pytest.raises((RuntimeError, TimeoutError, OSError)):
        proxy.start(timeout=40)
    proxy.stop()
    log = (tmp_path / "p.log").read_text(errors="replace")
    lines = [line for line in log.splitlines() if "KVPROXY_UPSTREAM_API_KEY" in line]
    assert lines and "401" in lines[0], log[-2000:]
