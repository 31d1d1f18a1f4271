"""Request bodies are bounded: 413 in the client's own format before the body is read,
chunked bodies cut off at the bound, uploads refused unread."""
from __future__ import annotations

import io
import json

import pytest
import responses
from werkzeug.test import EnvironBuilder, run_wsgi_app

from kvproxy import create_app
from tests.fake_llama import UPSTREAM, FakeLlama

LIMIT_MB = 0.0625  # 64 KiB for these tests
LIMIT = int(LIMIT_MB * 1024 * 1024)


class Untouchable(io.RawIOBase):
    """A request body that fails the test if anything reads it."""

    def readable(self):
        return True

    def readinto(self, buffer):
        raise AssertionError("the body was read")


@pytest.fixture
def app_and_fake(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path)
        yield create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                          "max_body_mb": LIMIT_MB}), fake


def shape_of(path: str, body: dict) -> str:
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
        return "anthropic"
    if path.startswith("/v1/"):
        assert set(body["error"]) == {"message", "type", "param", "code"}
        return "openai"
    assert isinstance(body["error"], str)
    return "ollama"


def raw_body(stream, length: int | None) -> dict:
    """WSGI environ for a body the test client must not touch; no length: chunked, as
    gunicorn passes it (``wsgi.input_terminated``)."""
    environ = {"wsgi.input": stream, "CONTENT_TYPE": "application/json"}
    if length is None:
        return environ | {"wsgi.input_terminated": True, "HTTP_TRANSFER_ENCODING": "chunked"}
    return environ | {"CONTENT_LENGTH": str(length)}


CHAT_ROUTES = ["/api/chat", "/api/generate", "/api/embed", "/api/embeddings",
               "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages",
               "/v1/messages/count_tokens", "/api/create", "/api/blobs/sha256:abc"]


@pytest.mark.parametrize("path", CHAT_ROUTES)
def test_a_large_content_length_is_413_before_reading(app_and_fake, path):
    app, fake = app_and_fake
    reply = app.test_client().post(path, environ_overrides=raw_body(Untouchable(), LIMIT + 1))
    assert reply.status_code == 413, reply.get_data(as_text=True)
    shape_of(path, reply.get_json())
    assert "KVPROXY_MAX_BODY_MB" in reply.get_data(as_text=True)
    assert reply.headers["Connection"] == "close"
    assert fake.actions == []


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions", "/v1/messages"])
def test_a_chunked_body_is_cut_off_at_the_bound(app_and_fake, path):
    """No Content-Length (chunked upload): read only up to the bound, then 413."""
    app, fake = app_and_fake
    endless = io.BytesIO(b'{"messages": "' + b"x" * (LIMIT * 50) + b'"}')
    environ = EnvironBuilder(path=path, method="POST").get_environ()
    environ.pop("CONTENT_LENGTH", None)
    environ.update(raw_body(endless, None))
    # the test client drops wsgi.input_terminated: call the app as gunicorn does
    chunks, status, _headers = run_wsgi_app(app.wsgi_app, environ, buffered=True)
    assert status.startswith("413"), status
    shape_of(path, json.loads(b"".join(chunks)))
    assert endless.tell() <= LIMIT + 64 * 1024, "more than the bound was read"
    assert fake.actions == []


def test_a_body_under_the_bound_is_served(app_and_fake):
    app, _ = app_and_fake
    text = "y" * (LIMIT // 2)
    reply = app.test_client().post("/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": text}]})
    assert reply.status_code == 200


def test_blob_uploads_are_refused_unread(app_and_fake):
    """``ollama create`` uploads blobs first: a clear 4xx in Ollama's format, nothing read."""
    app, fake = app_and_fake
    client = app.test_client()
    assert client.head("/api/blobs/sha256:" + "0" * 64).status_code == 404
    reply = client.post("/api/blobs/sha256:" + "0" * 64,
                        environ_overrides=raw_body(Untouchable(), LIMIT - 1))
    assert reply.status_code == 400
    assert "serves the one model" in reply.get_json()["error"]
    assert reply.headers["Connection"] == "close"
    create = client.post("/api/create", json={"model": "mine", "files": {"a.gguf": "sha256:0"}})
    assert create.status_code == 400 and "serves the one model" in create.get_json()["error"]
    assert fake.actions == []


def test_the_default_bound_fits_long_prompts_and_images():
    from kvproxy.config import load_settings
    assert load_settings({}).max_body_mb >= 32
