"""The shared store's pieces: where objects go (users apart), the session object and which save
wins, the bucket client's calls and errors, and one session copied up. The bucket is a real
SeaweedFS (``weed mini``, the ``weed`` and ``store_url`` fixtures), never a mock of S3."""
from __future__ import annotations

import pytest

from kvproxy.config import ConfigError, load_settings
from kvproxy.errors import StoreError, StoreUnavailable
from kvproxy.launch.processes import free_port
from kvproxy.sessions.identity import Session, owner_tag, owner_tag_of
from kvproxy.storage.chunks import manifest
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.shared import session_object
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation, user_of
from kvproxy.storage.shared.publish import GONE, NEWER_THERE, WRITTEN, KnownChunks, publish
from kvproxy.storage.store import SessionStore
from tests.support import save_chunked

C = 16
TOKENS = list(range(100, 180))    # 5 chunks of 16
LATER = "2026-12-06T00:00:05.000+00:00"


# -- where objects go ----------------------------------------------------------------------
def test_the_url_names_a_bucket_and_a_prefix():
    assert StoreLocation.parse("s3://kv-store/prod/node") == StoreLocation("kv-store", "prod/node")
    assert StoreLocation.parse("s3://kv-store/") == StoreLocation("kv-store", "")
    assert StoreLocation.parse("s3://kv-store/a/").url == "s3://kv-store/a"


@pytest.mark.parametrize("url", ["http://kv-store/a", "s3://KV/a", "s3://ab", "s3://kv/a b",
                                 "s3://key:secret@kv-store/a", "s3://kv-store/../a b"])
def test_a_url_that_is_not_a_bucket_stops_start_up_without_echoing_it(url):
    with pytest.raises(ConfigError) as refused:
        load_settings({"KVPROXY_STORE_URL": url})
    assert "KVPROXY_STORE_URL=(hidden) is invalid" in str(refused.value)
    assert "secret" not in str(refused.value)


def test_the_setting_is_off_when_empty():
    assert load_settings({}).store_url == ""
    assert load_settings({"KVPROXY_STORE_URL": "s3://kv-store/p"}).store_url == "s3://kv-store/p"


def test_each_user_has_a_prefix_of_their_own():
    where = StoreLocation("kv", "p")
    alice = Session("chat", "header", owner="alice", model="m")
    base_of_bob = f"base.{owner_tag('bob')}.abcd@m"
    assert owner_tag_of(alice.stem) == owner_tag("alice")
    assert owner_tag_of(base_of_bob) == owner_tag("bob")
    assert owner_tag_of(Session("chat", "header", model="m").stem) is None
    assert owner_tag_of("base.abcd@m") is None
    assert where.session(user_of(alice.stem), alice.stem) == \
        f"p/users/{owner_tag('alice')}/sessions/{alice.stem}"
    assert where.chunk(user_of("base.abcd@m"), "ab12") == "p/users/_/chunks/ab/ab12"
    assert where.chunk(user_of(alice.stem), "ab12") != where.chunk(user_of(base_of_bob), "ab12")


# -- the session object ----------------------------------------------------------------------
def test_a_session_object_round_trips_and_names_its_generation():
    sidecar = {"saved_at": "2026-12-06T00:00:01.500+00:00", "n_tokens": 5}
    generation = session_object.generation_of(sidecar)
    stored = session_object.SessionObject(generation, "s", sidecar, b"manifest bytes")
    back = session_object.decode(stored.encode())
    assert back == stored and stored.metadata == {"generation": str(generation)}
    assert session_object.generation_of({"saved_at": LATER}) > generation
    with pytest.raises(session_object.SessionObjectError):
        session_object.decode(b"KVPSTORE" + (9).to_bytes(4, "little") + bytes(8))


def test_only_a_newer_save_replaces_the_stored_one():
    assert session_object.replaces(5, None)
    assert session_object.replaces(6, 5)
    assert not session_object.replaces(5, 5), "a tie keeps the first writer's"
    assert not session_object.replaces(4, 5)


# -- the bucket client ---------------------------------------------------------------------
@pytest.fixture
def bucket(store_url):
    return Bucket(StoreLocation.parse(store_url), timeout=5)


def test_put_if_absent_is_first_writer_wins(bucket):
    assert bucket.put_if_absent("k/a", b"one")
    assert not bucket.put_if_absent("k/a", b"two")
    body, head = bucket.get("k/a")
    assert body == b"one" and head.size == 3


def test_replace_goes_only_over_the_object_it_read(bucket):
    assert bucket.replace("m", b"v1", None, {"generation": "1"})
    assert not bucket.replace("m", b"v1 again", None), "a first write finds one there"
    head = bucket.head("m")
    assert head.metadata == {"generation": "1"}
    assert bucket.replace("m", b"v2", head.etag, {"generation": "2"})
    assert not bucket.replace("m", b"v3", head.etag, {"generation": "3"}), "a stale ETag"
    assert bucket.get("m")[0] == b"v2"


def test_get_head_list_and_delete(bucket):
    assert bucket.get("none") is None and bucket.head("none") is None
    bucket.put("d/1", b"a")
    bucket.put("d/2", b"bb")
    assert sorted(bucket.keys("d/")) == [("d/1", 1), ("d/2", 2)]
    bucket.delete("d/1")
    assert [k for k, _ in bucket.keys("d/")] == ["d/2"]
    bucket.reachable()


def test_a_wrong_secret_is_refused_without_showing_any_credential(store_url, weed, monkeypatch,
                                                                  caplog):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-0123456789")
    bucket = Bucket(StoreLocation.parse(store_url), timeout=5)
    with pytest.raises(StoreError) as refused:
        bucket.put_if_absent("k", b"x")
    text = str(refused.value)
    assert "refused put" in text and "AWS_SECRET_ACCESS_KEY" in text
    for secret in ("wrong-secret-0123456789", weed.access_key, weed.secret_key):
        assert secret not in text and secret not in caplog.text


def test_a_missing_bucket_says_to_create_it(store_url):
    """(A write would not tell: SeaweedFS creates a missing bucket on an admin's first
    upload, ``-s3.autoCreateBucket``; AWS S3 and MinIO answer NoSuchBucket.)"""
    bucket = Bucket(StoreLocation("no-such-bucket-kv", "p"), timeout=5)
    with pytest.raises(StoreError, match="bucket no-such-bucket-kv does not exist"):
        bucket.reachable()


def test_an_unreachable_store_is_unavailable_within_its_bounds(store_url, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://user:pw@127.0.0.1:{free_port()}")
    bucket = Bucket(StoreLocation.parse(store_url), timeout=1)
    with pytest.raises(StoreUnavailable) as down:
        bucket.head("k")
    assert "cannot reach the shared store at http://127.0.0.1:" in str(down.value)
    assert "pw" not in str(down.value)


# -- one session copied up ---------------------------------------------------------------------
@pytest.fixture
def files(tmp_path):
    return ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)


def stored_object(bucket, stem):
    body, _ = bucket.get(bucket.location.session(user_of(stem), stem))
    return session_object.decode(body)


def test_a_packed_session_is_copied_up_chunks_first(bucket, files):
    alice = Session("chat", "header", owner="alice", model="m").stem
    save_chunked(files, alice, TOKENS + [1, 2, 3])
    done = publish(bucket, files, alice)
    assert done.outcome == WRITTEN and done.chunks == 5
    user = user_of(alice)
    keys = manifest.read_keys(files.store.chunked_path(alice))
    for key in keys:
        assert bucket.get(bucket.location.chunk(user, key))[0] == files.chunks.read(key)
    stored = stored_object(bucket, alice)
    assert stored.manifest == files.store.chunked_path(alice).read_bytes()
    assert stored.sidecar == files.store.read_sidecar(alice)
    assert {k for k, _ in bucket.keys(bucket.location.user_prefix(user))} == \
        {bucket.location.chunk(user, k) for k in keys} | {bucket.location.session(user, alice)}


def test_a_second_turn_writes_only_its_new_chunks(bucket, files):
    known = KnownChunks()
    save_chunked(files, "s", TOKENS)
    assert publish(bucket, files, "s", known).chunks == 5
    save_chunked(files, "s", TOKENS + list(range(40)), saved_at=LATER)
    done = publish(bucket, files, "s", known)
    assert done.outcome == WRITTEN and done.chunks == 2
    assert len(session_object.decode(bucket.get(bucket.location.session("_", "s"))[0])
               .manifest) == len(files.store.chunked_path("s").read_bytes())


def test_chunks_another_node_wrote_are_left_as_they_are(bucket, tmp_path):
    one = ChunkedFiles(SessionStore(tmp_path / "one"), chunk_tokens=C)
    two = ChunkedFiles(SessionStore(tmp_path / "two"), chunk_tokens=C)
    save_chunked(one, "a", TOKENS)
    save_chunked(two, "b", TOKENS + list(range(16)))
    assert publish(bucket, one, "a").chunks == 5
    assert publish(bucket, two, "b").chunks == 1, "the shared prefix is there already"


def test_an_older_save_never_replaces_a_newer_one(bucket, tmp_path, caplog):
    """Two nodes carrying one conversation (a balancer that sent it to both): the later save
    is kept, whichever node uploads last."""
    newer = ChunkedFiles(SessionStore(tmp_path / "newer"), chunk_tokens=C)
    older = ChunkedFiles(SessionStore(tmp_path / "older"), chunk_tokens=C)
    save_chunked(newer, "s", TOKENS + list(range(32)), saved_at=LATER)
    save_chunked(older, "s", TOKENS)
    assert publish(bucket, newer, "s").outcome == WRITTEN
    assert publish(bucket, older, "s").outcome == NEWER_THERE
    assert stored_object(bucket, "s").generation == \
        session_object.generation_of({"saved_at": LATER})
    # and the other way round: the later save goes over the earlier
    save_chunked(newer, "t", TOKENS + list(range(32)), saved_at=LATER)
    save_chunked(older, "t", TOKENS)
    assert publish(bucket, older, "t").outcome == WRITTEN
    assert publish(bucket, newer, "t").outcome == WRITTEN
    assert stored_object(bucket, "t").manifest == newer.store.chunked_path("t").read_bytes()


def test_nothing_is_copied_of_a_session_that_is_gone_or_not_packed(bucket, files):
    assert publish(bucket, files, "never").outcome == GONE
    save_chunked(files, "s", TOKENS)
    files.store.bin_path("s").write_bytes(b"a newer whole save, not packed yet")
    assert publish(bucket, files, "s").outcome == GONE
    assert list(bucket.keys(bucket.location.user_prefix("_"))) == []


def test_a_chunk_freed_before_its_upload_leaves_no_manifest(bucket, files):
    save_chunked(files, "s", TOKENS)
    files.chunks.remove(manifest.read_keys(files.store.chunked_path("s"))[3])
    assert publish(bucket, files, "s").outcome == GONE
    assert bucket.head(bucket.location.session("_", "s")) is None



class Recording(Bucket):
    """The real bucket, recording the order of its writes."""

    def __init__(self, *args):
        super().__init__(*args)
        self.writes = []

    def put_if_absent(self, key, body, metadata=None):
        self.writes.append(key)
        return super().put_if_absent(key, body, metadata)

    def replace(self, key, body, etag, metadata=None):
        self.writes.append(key)
        return super().replace(key, body, etag, metadata)


def test_the_session_object_is_written_after_every_chunk_it_names(store_url, files):
    """So a node killed during an upload never leaves a manifest naming a missing chunk."""
    bucket = Recording(StoreLocation.parse(store_url), 5)
    save_chunked(files, "s", TOKENS)
    publish(bucket, files, "s")
    session = bucket.location.session("_", "s")
    assert bucket.writes[-1] == session and session not in bucket.writes[:-1]
    assert len(bucket.writes) == 6
