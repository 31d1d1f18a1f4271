"""The route table (kvproxy.routes) is what the app serves, what docs/routes.md shows, and
decides the error shape and the admin token of every route."""
from pathlib import Path

import pytest

from kvproxy import create_app, routes

DOC = Path(__file__).resolve().parent.parent / "docs" / "routes.md"


@pytest.fixture
def app(tmp_path):
    return create_app({"slot_dir": str(tmp_path), "upstream": "http://127.0.0.1:9",
                       "admin_token": "s3cret"})


def declared(methods) -> tuple[str, ...]:
    """Methods as declared: Flask adds HEAD to GET rules and OPTIONS to all."""
    return tuple(sorted(set(methods) - {"OPTIONS"} - ({"HEAD"} if "GET" in methods else set())))


def test_the_app_serves_the_table_and_nothing_else(app):
    served = {(rule.rule, declared(rule.methods), rule.endpoint, tuple(sorted(
        (rule.defaults or {}).items()))) for rule in app.url_map.iter_rules()}
    table = {(route.path, declared(route.methods), route.endpoint,
              tuple(sorted((route.defaults or {}).items()))) for route in routes.ROUTES}
    assert served == table
    assert len(routes.ROUTES) == len(routes.BY_PATH) == 66, "one row per rule"


def test_docs_routes_md_is_the_table():
    assert DOC.read_text() == routes.document(), \
        "docs/routes.md is out of date: python -m kvproxy.routes > docs/routes.md"


ADMIN_ROUTES = [route for route in routes.ROUTES
                if route.token == routes.EVERY and route.family == "admin"]


@pytest.mark.parametrize("route", ADMIN_ROUTES, ids=[r.path for r in ADMIN_ROUTES])
def test_every_admin_route_refuses_a_missing_token_in_the_admin_shape(app, route):
    path = route.path.replace("<path:session_id>", "someone")
    reply = app.test_client().open(path, method=route.methods[0])
    assert reply.status_code == 401
    assert reply.get_json() == {"code": 401, "status": "Unauthorized", "message":
                                "missing or wrong admin token: send 'Authorization: Bearer <token>'"}


def test_api_slots_refuses_a_missing_token_in_the_admin_shape_not_ollamas(app):
    reply = app.test_client().get("/api/slots")
    assert reply.status_code == 401 and reply.get_json()["code"] == 401
    assert "error" not in reply.get_json()
    assert app.test_client().get("/api/slots", headers={
        "Authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.parametrize("path,shape", [
    ("/v1/nothing", routes.OPENAI), ("/v1/messages/batches", routes.ANTHROPIC),
    ("/api/nothing", routes.OLLAMA), ("/nothing", routes.OLLAMA), ("/", routes.OLLAMA),
    ("/api/status/more", routes.ADMIN), ("/slots/0/more", routes.OPENAI),
    ("/chat/anything", routes.OPENAI), ("/health/more", routes.OLLAMA)])
def test_an_unknown_path_answers_in_the_shape_of_its_nearest_routes(path, shape):
    assert routes.nearest_shape(path) == shape


def test_a_bug_reads_the_same_in_every_family(app, monkeypatch):
    """Wherever it happens, a bug is a 500 saying where, in its API's shape."""
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(app.extensions["kvproxy.relay"].facts, "of", broken)
    monkeypatch.setattr(app.extensions["kvproxy.switch"], "slot_listing", broken)
    client = app.test_client()
    said = {
        "GET /v1/models": client.get("/v1/models").get_json()["error"]["message"],
        "POST /v1/messages": client.post("/v1/messages", json={
            "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        ).get_json()["error"]["message"],
        "GET /api/tags": client.get("/api/tags").get_json()["error"],
        "GET /api/slots": client.get("/api/slots", headers={
            "Authorization": "Bearer s3cret"}).get_json()["message"],
    }
    assert said == {where: f"{where}: internal error in kvproxy; see its log" for where in said}
