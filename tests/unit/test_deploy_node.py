"""X-KVProxy-Node: every reply names the machine that answered (KVPROXY_NODE_NAME)."""
import socket

import pytest

from kvproxy import create_app
from kvproxy.config import ConfigError, load_settings
from kvproxy.launch.processes import free_port


@pytest.fixture
def client(tmp_path):
    app = create_app({"slot_dir": str(tmp_path), "upstream": f"http://127.0.0.1:{free_port()}",
                      "connect_timeout": 1, "node_name": "gpu-2"})
    return app.test_client()


@pytest.mark.parametrize("method, path, body", [
    ("get", "/health", None),                                     # 503: llama-server is down
    ("get", "/no/such/route", None),                              # 404
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),  # 502
    ("post", "/api/chat", {"model": "m", "messages": "not a list"}),                       # 400
    ("get", "/api/sessions", None),                               # admin API
    ("get", "/metrics", None),
])
def test_every_reply_names_the_node(client, method, path, body):
    reply = getattr(client, method)(path, json=body) if body else getattr(client, method)(path)
    assert reply.headers["X-KVProxy-Node"] == "gpu-2", (reply.status_code, path)


def test_default_is_the_host_name():
    assert load_settings({}).node_name == socket.gethostname()
    assert load_settings({"KVPROXY_NODE_NAME": "  "}).node_name == socket.gethostname()


def test_a_name_that_could_break_the_header_is_refused():
    with pytest.raises(ConfigError, match="KVPROXY_NODE_NAME"):
        load_settings({"KVPROXY_NODE_NAME": "a\r\nX-Evil: 1"})
