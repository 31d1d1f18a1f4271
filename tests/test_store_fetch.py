"""Fetch on miss: a conversation another node saved comes from the shared store into an empty
slot folder, chunks and all, and is put together byte for byte; only under the caller's own
user; a fetch that fails leaves nothing and says so in one line. Against a real SeaweedFS."""
from __future__ import annotations

import logging

import pytest

from kvproxy.sessions.identity import Session
from kvproxy.storage.chunks import manifest
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation, user_of
from kvproxy.storage.shared.publish import publish
from kvproxy.storage.shared.store import SharedStore
from kvproxy.storage.store import SessionStore
from tests.slot_files import slot_file
from tests.support import metric, save_chunked

C = 16
TOKENS = list(range(100, 180)) + [7, 8, 9]
ALICE = Session("notes", "header", owner="alice", model="m")
BOB = Session("notes", "header", owner="bob", model="m")


@pytest.fixture
def nodes(store_url, tmp_path):
    """Two nodes' slot folders over one bucket: ``one`` saved and uploaded, ``two`` empty."""
    shared = SharedStore(Bucket(StoreLocation.parse(store_url), 5), fetch_seconds=20)
    one = ChunkedFiles(SessionStore(tmp_path / "one"), chunk_tokens=C)
    two = ChunkedFiles(SessionStore(tmp_path / "two"), chunk_tokens=C, shared=shared)
    yield one, two, shared
    shared.close()


def restored(files: ChunkedFiles, stem: str) -> bytes:
    with files.staged(stem) as name:
        return (files.store.root / name).read_bytes()


def test_a_session_another_node_saved_is_fetched_and_put_together_byte_for_byte(nodes):
    one, two, shared = nodes
    save_chunked(one, ALICE.stem, TOKENS)
    publish(shared.bucket, one, ALICE.stem)
    fetched = metric("kvproxy_store_fetches_total", outcome="fetched")
    assert not two.has(ALICE.stem)
    assert two.fetch(ALICE.stem)
    assert two.has(ALICE.stem) and two.check(ALICE.stem)[1] is None
    assert restored(two, ALICE.stem) == slot_file(TOKENS)
    sidecar = two.store.read_sidecar(ALICE.stem)
    assert sidecar["saved_at"] == one.store.read_sidecar(ALICE.stem)["saved_at"]
    assert sidecar["fetched_generation"] > 0
    assert metric("kvproxy_store_fetches_total", outcome="fetched") - fetched == 1
    assert not two.fetch(ALICE.stem), "a session the folder has is not fetched again"


def test_a_session_fetched_and_carried_on_by_one_node_is_fetched_by_the_next(nodes, tmp_path):
    """Node two fetched it and saved a later turn (its sidecar names the fetch), node three
    fetches that save: the lost node, the node that took over, then a new node."""
    one, two, shared = nodes
    save_chunked(one, ALICE.stem, TOKENS[:48])
    publish(shared.bucket, one, ALICE.stem)
    assert two.fetch(ALICE.stem)
    first = two.store.read_sidecar(ALICE.stem)["fetched_generation"]
    save_chunked(two, ALICE.stem, TOKENS, saved_at="2026-12-06T00:00:01.000+00:00", merged=True)
    assert two.store.read_sidecar(ALICE.stem)["fetched_generation"] == first
    publish(shared.bucket, two, ALICE.stem)
    three = ChunkedFiles(SessionStore(tmp_path / "three"), chunk_tokens=C, shared=shared)
    assert three.fetch(ALICE.stem)
    assert restored(three, ALICE.stem) == slot_file(TOKENS)
    assert three.store.read_sidecar(ALICE.stem)["fetched_generation"] == first + 1000


def test_only_the_chunks_the_folder_lacks_are_fetched(nodes):
    one, two, shared = nodes
    save_chunked(one, ALICE.stem, TOKENS)
    publish(shared.bucket, one, ALICE.stem)
    save_chunked(two, "local", TOKENS[:48])   # three chunks of the same start, stored here
    before = metric("kvproxy_store_fetch_bytes_total")
    assert two.fetch(ALICE.stem)
    chunk = two.chunks.size(manifest.read_keys(two.store.chunked_path(ALICE.stem))[0])
    object_size = shared.bucket.head(shared.bucket.location.session(user_of(ALICE.stem),
                                                                    ALICE.stem)).size
    assert metric("kvproxy_store_fetch_bytes_total") - before == 2 * chunk + object_size


def test_a_user_cannot_fetch_another_users_conversation(nodes):
    one, two, shared = nodes
    save_chunked(one, ALICE.stem, TOKENS)
    publish(shared.bucket, one, ALICE.stem)
    assert BOB.stem != ALICE.stem and user_of(BOB.stem) != user_of(ALICE.stem)
    assert not two.fetch(BOB.stem)
    assert not two.has(BOB.stem) and not list(two.chunks.keys())


def test_a_session_not_in_the_store_is_a_plain_miss(nodes, caplog):
    _, two, _ = nodes
    missing = metric("kvproxy_store_fetches_total", outcome="not in the store")
    with caplog.at_level(logging.INFO, logger="kvproxy.store"):
        assert not two.fetch("never-saved")
    assert metric("kvproxy_store_fetches_total", outcome="not in the store") - missing == 1
    assert not caplog.records


def test_a_fetch_that_fails_leaves_nothing_and_says_so_in_one_line(nodes, caplog):
    one, two, shared = nodes
    save_chunked(one, ALICE.stem, TOKENS)
    publish(shared.bucket, one, ALICE.stem)
    key = manifest.read_keys(one.store.chunked_path(ALICE.stem))[2]
    shared.bucket.delete(shared.bucket.location.chunk(user_of(ALICE.stem), key))
    with caplog.at_level(logging.WARNING, logger="kvproxy.store"):
        assert not two.fetch(ALICE.stem)
    assert not two.has(ALICE.stem) and two.store.read_sidecar(ALICE.stem) is None
    [line] = [r.getMessage() for r in caplog.records]
    assert "could not fetch" in line and "computing it instead" in line and key[:12] in line


def test_a_fetch_past_its_deadline_is_computed_instead(nodes, caplog):
    one, two, shared = nodes
    save_chunked(one, ALICE.stem, TOKENS)
    publish(shared.bucket, one, ALICE.stem)
    shared.fetch_seconds = 1e-6
    with caplog.at_level(logging.WARNING, logger="kvproxy.store"):
        assert not two.fetch(ALICE.stem)
    assert not two.has(ALICE.stem)
    assert "KVPROXY_STORE_FETCH_SECONDS" in caplog.text


def test_a_stored_chunk_of_the_wrong_size_never_reaches_the_folder(nodes, caplog):
    one, two, shared = nodes
    save_chunked(one, ALICE.stem, TOKENS)
    publish(shared.bucket, one, ALICE.stem)
    key = manifest.read_keys(one.store.chunked_path(ALICE.stem))[1]
    name = shared.bucket.location.chunk(user_of(ALICE.stem), key)
    shared.bucket.put(name, b"short")
    with caplog.at_level(logging.WARNING, logger="kvproxy.store"):
        assert not two.fetch(ALICE.stem)
    assert not two.chunks.has(key) and not two.has(ALICE.stem)
    assert "has 5 bytes" in caplog.text
