"""Every route family answers unknown paths, wrong methods and bad bodies in its own shape."""
import pytest

from kvproxy import create_app
from kvproxy.upstream.llama import upstream_error


@pytest.fixture
def client(tmp_path):
    return create_app({"slot_dir": str(tmp_path), "upstream": "http://127.0.0.1:9"}).test_client()


def test_openai_family(client):
    for reply in (client.get("/v1/nothing"), client.get("/v1/chat/completions"),
                  client.post("/v1/chat/completions", data=b"[", content_type="application/json")):
        error = reply.get_json()["error"]
        assert reply.status_code in (400, 404, 405)
        assert {"message", "type", "param", "code"} <= set(error)


def test_anthropic_family(client):
    for reply in (client.get("/v1/messages/batches"), client.get("/v1/messages"),
                  client.post("/v1/messages", json={"model": "m", "messages": []})):
        body = reply.get_json()
        assert reply.status_code in (400, 404, 405)
        assert body["type"] == "error" and body["error"]["type"].endswith("_error")


def test_ollama_family(client):
    for reply in (client.get("/api/nothing"), client.get("/api/chat"),
                  client.post("/api/chat", data=b"{", content_type="application/json")):
        body = reply.get_json()
        assert reply.status_code in (400, 404, 405)
        assert set(body) == {"error"} and isinstance(body["error"], str)


def test_wrong_method_keeps_allow_header(client):
    reply = client.get("/v1/chat/completions")
    assert reply.status_code == 405 and "POST" in reply.headers["Allow"]


def test_admin_api_keeps_its_own_shape(client):
    reply = client.delete("/api/sessions/nobody")
    assert reply.status_code == 404 and reply.get_json()["code"] == 404


@pytest.mark.parametrize("message, status", [
    ("image input is not supported - hint: if this is unexpected, you may need to provide "
     "the mmproj", 400),
    ("audio input is not supported - hint: ...", 400),
    ("video input is not supported - hint: ...", 400),
    ("Failed to parse messages: [json.exception.type_error.302] type must be string", 400),
    ("failed to decode image bytes", 500),  # llama-server's own fault stays a 500
])
def test_llama_servers_500s_that_can_never_succeed_are_a_400(message, status):
    """docs/clients.md lists these: an SDK retries a 500, and this request never succeeds."""
    error = upstream_error(500, message)
    assert (error.status, error.message) == (status, message)
