"""The gate's decision on who calls, from facts alone (``kvproxy.web.gate.judge``); the
app-level behaviour is in test_users.py, test_admin.py, test_guard.py and test_routes.py."""
import pytest

from kvproxy import routes
from kvproxy.errors import MISSING_KEY
from kvproxy.web import gate

ALICE = "alice-key-0123456789"
KEYS = {ALICE: "alice"}
BOTH = gate.Credentials(b"Bearer s3cret", KEYS)
TOKEN_ONLY = gate.Credentials(b"Bearer s3cret", {})
NEITHER = gate.Credentials(None, {})


def judge(kind, credentials, headers, method="GET", path="/x", family="openai"):
    return gate.judge(kind, credentials, headers, method, path, family)


@pytest.mark.parametrize("credentials", [BOTH, TOKEN_ONLY, NEITHER])
def test_an_open_route_lets_anyone_in(credentials):
    assert judge(routes.OPEN, credentials, {}) == gate.LET_IN


def test_a_key_route_needs_a_users_key_only_when_keys_are_set():
    assert judge(routes.KEY, TOKEN_ONLY, {}) == gate.LET_IN
    assert judge(routes.KEY, BOTH, {"x-api-key": ALICE}) == gate.Verdict(user="alice")
    assert judge(routes.KEY, BOTH, {"Authorization": f"bearer {ALICE}"}).user == "alice"
    assert judge(routes.KEY, BOTH, {"Authorization": "Bearer s3cret"}).refused == MISSING_KEY
    assert judge(routes.KEY, BOTH, {}).refused == MISSING_KEY


def test_an_admin_route_needs_the_exact_token_header_when_a_token_is_set():
    assert judge(routes.TOKEN, NEITHER, {}) == gate.LET_IN
    for credentials in (BOTH, TOKEN_ONLY):
        assert judge(routes.TOKEN, credentials, {"Authorization": "Bearer s3cret"}) == gate.LET_IN
        for sent in ({}, {"Authorization": "bearer s3cret"}, {"x-api-key": "s3cret"},
                     {"Authorization": f"Bearer {ALICE}"}):
            assert judge(routes.TOKEN, credentials, sent, family="admin").refused == \
                gate.ADMIN_TOKEN


def test_a_write_for_every_client_says_why_it_needs_the_token():
    refused = judge(routes.TOKEN, BOTH, {}, method="POST", path="/props", family="passthrough")
    assert refused.refused == ("POST /props changes llama-server for every client: send "
                               "'Authorization: Bearer <admin token>'")
    assert judge(routes.TOKEN, BOTH, {}, path="/slots", family="passthrough").refused == \
        gate.ADMIN_TOKEN


def test_the_listing_takes_the_token_or_a_users_key():
    assert judge(routes.TOKEN_OR_KEY, BOTH, {"Authorization": "Bearer s3cret"}) == gate.LET_IN
    assert judge(routes.TOKEN_OR_KEY, BOTH, {"x-api-key": ALICE}) == gate.Verdict(user="alice")
    assert judge(routes.TOKEN_OR_KEY, BOTH, {"x-api-key": "wrong-key-0123456789"},
                 family="admin").refused == gate.ADMIN_TOKEN
    assert judge(routes.TOKEN_OR_KEY, TOKEN_ONLY, {"x-api-key": ALICE},
                 family="admin").refused == gate.ADMIN_TOKEN
    assert judge(routes.TOKEN_OR_KEY, NEITHER, {}) == gate.LET_IN


def test_one_before_request_hook_checks_what_the_table_says(tmp_path):
    from kvproxy import create_app
    app = create_app({"slot_dir": str(tmp_path), "upstream": "http://127.0.0.1:9"})
    hooks = app.before_request_funcs[None]
    assert sum(isinstance(getattr(hook, "__self__", None), gate.Gate) for hook in hooks) == 1
    assert len(hooks) <= 2  # the gate, and the request clock of the request log
