"""Saved sessions pushed to the shared store behind the request path: a bounded queue that
keeps one entry per conversation, retries with backoff, and a store outage that degrades
/health but costs no save and no answer. Against a real SeaweedFS (``weed mini``)."""
from __future__ import annotations

import threading
import time

import pytest

from kvproxy import create_app
from kvproxy.ops import startup
from kvproxy.launch.processes import free_port
from kvproxy.sessions.identity import Session
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.shared import session_object
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation, user_of
from kvproxy.storage.shared.store import SharedStore
from kvproxy.storage.shared import uploader as uploader_module
from kvproxy.storage.shared.publish import GONE, Published, publish
from kvproxy.storage.shared.uploader import MAX_BACKOFF, next_backoff
from kvproxy.storage.store import SessionStore
from tests.fake_llama import UPSTREAM
from kvproxy.launch.seaweed import WeedMini, weed_binary, MISSING
from tests.support import metric, save_chunked, wait_until

C = 16
TOKENS = list(range(100, 180))
LATER = "2026-12-06T00:00:05.000+00:00"


def stored_generation(bucket: Bucket, stem: str) -> int | None:
    head = bucket.head(bucket.location.session(user_of(stem), stem))
    return session_object.generation_in(head.metadata) if head else None


def chunked(tmp_path, shared) -> ChunkedFiles:
    return ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C, shared=shared)


def test_the_backoff_doubles_up_to_its_bound():
    waits, wait = [], 0.0
    for _ in range(10):
        wait = next_backoff(wait)
        waits.append(wait)
    assert waits[:3] == [0.5, 1.0, 2.0] and waits[-1] == MAX_BACKOFF


def test_a_packed_save_is_uploaded_in_the_background(store_url, tmp_path):
    shared = SharedStore(Bucket(StoreLocation.parse(store_url), 5))
    files = chunked(tmp_path, shared)
    stem = Session("chat", "header", owner="alice", model="m").stem
    before = metric("kvproxy_store_upload_bytes_total", kind="chunk")
    save_chunked(files, stem, TOKENS)
    assert shared.uploader.wait_idle(30)
    assert stored_generation(shared.bucket, stem) == session_object.generation_of(
        files.store.read_sidecar(stem))
    assert metric("kvproxy_store_upload_bytes_total", kind="chunk") - before == \
        5 * files.chunks.size(next(iter(files.named()[stem])))
    assert shared.problem() is None
    shared.close()


@pytest.fixture
def dead_store(monkeypatch):
    """A store URL whose endpoint nobody answers (connections refused at once)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "kvproxy-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kvproxy-test-secret-value")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    shared = SharedStore(Bucket(StoreLocation("kv-store", "p"), 1), queue=2)
    yield shared
    shared.close()


def test_a_save_never_waits_for_the_store(dead_store, tmp_path):
    files = chunked(tmp_path, dead_store)
    started = time.monotonic()
    save_chunked(files, "s", TOKENS)
    assert time.monotonic() - started < 1.0
    assert files.store.chunked_path("s").is_file(), "the local copy is whole"
    deadline = time.monotonic() + 20
    while dead_store.problem() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "cannot reach the shared store" in dead_store.problem()
    assert "kvproxy-test-secret-value" not in dead_store.problem()


def test_the_queue_keeps_one_upload_per_conversation_and_drops_the_oldest_past_its_bound(
        dead_store, tmp_path, monkeypatch):
    files = chunked(tmp_path, None)
    uploader = dead_store.uploader
    release, calls = threading.Event(), []

    def held(bucket, files, stem, known):   # the thread's first upload waits: the queue fills
        calls.append(stem)
        release.wait(10)
        return Published(GONE)
    monkeypatch.setattr(uploader_module.publishing, "publish", held)
    dropped = metric("kvproxy_store_uploads_dropped_total")
    uploader.saved(files, "first")
    wait_until(lambda: calls == ["first"])
    for _ in range(3):   # three turns of one conversation: one entry
        uploader.saved(files, "a")
    uploader.saved(files, "b")
    assert list(uploader._pending) == ["a", "b"] and uploader.dropped == 0
    uploader.saved(files, "c")   # past the bound of 2 waiting: the oldest is dropped
    assert list(uploader._pending) == ["b", "c"] and uploader.dropped == 1
    assert metric("kvproxy_store_uploads_dropped_total") - dropped == 1
    assert metric("kvproxy_store_upload_queue") == 2
    release.set()
    assert uploader.wait_idle(10) and calls == ["first", "b", "c"]


@pytest.fixture
def own_weed(tmp_path_factory, monkeypatch):
    """A SeaweedFS of this test's own, to stop and start again."""
    if weed_binary() is None:
        pytest.skip(MISSING)
    tmp = tmp_path_factory.mktemp("own-weed")
    server = WeedMini(tmp / "data", tmp / "weed.log").start()
    try:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server
    finally:
        server.stop()


def test_a_store_outage_degrades_health_and_uploads_resume_when_it_returns(own_weed, tmp_path,
                                                                           fake):
    url = f"s3://{own_weed.new_bucket()}/kv"
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                      "store_url": url, "store_timeout": 1, "store_queue": 16,
                      "chunk_tokens": C})
    client = app.test_client()
    shared = app.extensions["kvproxy.shared_store"]
    files = app.extensions["kvproxy.switch"].files
    assert files.shared is shared and files.chunk_tokens == C
    save_chunked(files, "s", TOKENS)
    assert shared.uploader.wait_idle(30) and client.get("/health").json["status"] == "ok"

    own_weed.stop()
    save_chunked(files, "s", TOKENS + list(range(20)), saved_at=LATER)   # a turn meanwhile
    deadline = time.monotonic() + 30
    while shared.problem() is None:
        assert time.monotonic() < deadline, "the failed upload is not reported"
        time.sleep(0.1)
    health = client.get("/health")
    assert health.status_code == 200 and health.json["status"] == "degraded"
    assert "cannot reach the shared store" in health.json["store"]
    assert own_weed.secret_key not in health.text and own_weed.access_key not in health.text
    assert files.store.chunked_path("s").is_file()
    metrics = client.get("/metrics").text
    assert "kvproxy_store_upload_failures_total" in metrics

    own_weed.start()
    assert shared.uploader.wait_idle(60), "the upload did not resume"
    assert shared.problem() is None and client.get("/health").json["status"] == "ok"
    assert stored_generation(shared.bucket, "s") == session_object.generation_of({"saved_at": LATER})
    shared.close()


def test_a_conversation_deleted_here_is_deleted_from_the_bucket(store_url, tmp_path):
    shared = SharedStore(Bucket(StoreLocation.parse(store_url), 5))
    files = chunked(tmp_path, shared)
    save_chunked(files, "s", TOKENS)
    assert shared.uploader.wait_idle(30) and stored_generation(shared.bucket, "s") is not None
    assert files.delete("s")
    assert shared.uploader.wait_idle(30)
    assert stored_generation(shared.bucket, "s") is None
    shared.close()


def test_an_eviction_keeps_the_stored_copy(store_url, tmp_path):
    """The disk budget deletes a file to make room: the store behind keeps it."""
    shared = SharedStore(Bucket(StoreLocation.parse(store_url), 5))
    files = chunked(tmp_path, shared)
    save_chunked(files, "s", TOKENS)
    assert shared.uploader.wait_idle(30)
    files.store.delete("s")   # what eviction does
    files.free()
    assert shared.uploader.waiting() == 0
    assert stored_generation(shared.bucket, "s") is not None
    shared.close()


def test_at_exit_the_waiting_uploads_go(store_url, tmp_path):
    shared = SharedStore(Bucket(StoreLocation.parse(store_url), 5))
    save_chunked(chunked(tmp_path, shared), "s", TOKENS)
    assert shared.drain(30) and stored_generation(shared.bucket, "s") is not None


def test_at_exit_a_store_that_is_down_is_waited_for_within_a_bound(dead_store, tmp_path,
                                                                     caplog):
    save_chunked(chunked(tmp_path, dead_store), "s", TOKENS)
    started = time.monotonic()
    assert not dead_store.drain(0.5)
    assert time.monotonic() - started < 5
    assert "did not reach the shared store before exit" in caplog.text


def test_at_start_up_saves_the_bucket_lacks_are_caught_up_and_the_rest_only_checked(
        store_url, tmp_path):
    local = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)   # before the store was set
    save_chunked(local, "a", TOKENS)
    save_chunked(local, "b", TOKENS + list(range(16)))
    shared = SharedStore(Bucket(StoreLocation.parse(store_url), 5))
    publish_first = chunked(tmp_path, shared)
    publish(shared.bucket, publish_first, "a")                     # already up
    already = metric("kvproxy_store_uploads_total", outcome="already there")
    chunk_bytes = metric("kvproxy_store_upload_bytes_total", kind="chunk")
    assert shared.catch_up(local) == 0, "files that do not copy to this store are left alone"
    assert shared.catch_up(publish_first) == 2
    assert shared.uploader.wait_idle(30)
    assert stored_generation(shared.bucket, "b") is not None
    assert metric("kvproxy_store_uploads_total", outcome="already there") - already == 1
    chunk = publish_first.chunks.size(next(iter(publish_first.named()["b"])))
    assert metric("kvproxy_store_upload_bytes_total", kind="chunk") - chunk_bytes == chunk, \
        "only b's one new chunk"
    shared.close()


def test_the_start_up_check_has_the_shared_store_catch_up(tmp_path, fake, monkeypatch):
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                      "store_url": "s3://kv-store/p"})
    shared = app.extensions["kvproxy.shared_store"]
    seen = []
    monkeypatch.setattr(shared, "catch_up", seen.append)
    startup.check_at_start(app)
    assert seen == [app.extensions["kvproxy.switch"].files]
