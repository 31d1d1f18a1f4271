"""The route table (kvproxy.routes) is what the app serves, what docs/routes.md shows, and
decides the error shape and the admin token of every route."""
from pathlib import Path

import pytest

from kvproxy import create_app, routes

DOC = Path(__file__).resolve().parents[2] / "docs" / "routes.md"


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
    assert len(routes.ROUTES) == len(routes.BY_PATH) == 67, "one row per rule"


def test_docs_routes_md_is_the_table():
    assert DOC.read_text() == routes.document(), \
        "docs/routes.md is out of date: python -m kvproxy.routes > docs/routes.md"


ADMIN_ROUTES = [route for route in routes.ROUTES
                if route.family == "admin" and route.auth_for("GET") in (routes.TOKEN, routes.TOKEN_OR_KEY)]


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

    monkeypatch.setattr(app.extensions["kvproxy.relay"].models.view, "model_facts", broken)
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


def route_paths_named_outside_the_table() -> list[str]:
    """Module-level constants of kvproxy/ (the table aside) that name paths or endpoints of
    the table, or several of its families: a list of route facts kept by hand beside it."""
    import ast

    paths = set(routes.BY_PATH) | {route.endpoint for route in routes.ROUTES}
    found = []
    for module in sorted(routes.__file__ and Path(routes.__file__).parent.rglob("*.py")):
        if module.name == "routes.py" and module.parent.name == "kvproxy":
            continue
        for node in ast.parse(module.read_text()).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            strings = {value.value for value in ast.walk(node.value)
                       if isinstance(value, ast.Constant) and isinstance(value.value, str)}
            named = strings & paths
            if len(strings & set(routes.FAMILIES)) > 1:
                named |= strings & set(routes.FAMILIES)
            if named:
                found.append(f"{module.name}:{node.lineno} {sorted(named)}")
    return found


def test_no_route_fact_is_kept_beside_the_table():
    """Who may call, quiet, reads records, the blueprints: facts of the table's rows, not
    lists of paths in the modules that use them."""
    assert route_paths_named_outside_the_table() == []


def test_every_blueprint_of_the_table_is_registered_from_it(app):
    named = {route.endpoint.partition(".")[0] for route in routes.ROUTES if not route.added_by}
    assert named == set(routes.BLUEPRINTS)
    assert set(routes.BLUEPRINTS) <= set(app.blueprints)


@pytest.mark.parametrize("path,method,kind", [
    ("/", "GET", routes.OPEN), ("/health", "GET", routes.OPEN), ("/status", "GET", routes.OPEN),
    ("/v1/chat/completions", "POST", routes.KEY), ("/props", "GET", routes.KEY),
    ("/props", "HEAD", routes.KEY), ("/props", "POST", routes.TOKEN),
    ("/slots", "GET", routes.TOKEN), ("/api/slots", "GET", routes.TOKEN),
    ("/api/sessions", "GET", routes.TOKEN_OR_KEY), ("/api/sessions", "HEAD", routes.TOKEN_OR_KEY)])
def test_who_may_call_each_route(path, method, kind):
    assert routes.BY_PATH[path].auth_for(method) == kind
