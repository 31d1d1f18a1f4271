"""kvproxy in front of a llama-server that is not there: clear 503 answers with Retry-After."""
import pytest

from kvproxy import create_app
from kvproxy.launch.processes import free_port


@pytest.fixture
def app(tmp_path):
    return create_app({"slot_dir": str(tmp_path), "upstream": f"http://127.0.0.1:{free_port()}",
                       "connect_timeout": 1})


def test_unreachable_llama_server_is_503_with_retry_after_and_a_hint(app):
    """Stopped or restarting (make run starts it again): the client may retry."""
    reply = app.test_client().post("/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1
    assert "not reachable" in reply.json["error"]["message"]
    assert "KVPROXY_UPSTREAM" in reply.json["error"]["message"]


def test_health_is_503_when_llama_server_is_down(app):
    reply = app.test_client().get("/health")
    assert reply.status_code == 503 and reply.json["status"] == "unavailable"


def test_llama_server_loading_its_model_is_503_with_retry_after():
    """llama-server answers 503 while it loads its model (after make run restarted it)."""
    from kvproxy.upstream.llama import upstream_error
    error = upstream_error(503, "Loading model")
    assert error.status == 503 and error.headers == {"Retry-After": "5"}
