"""Uploads and sweeps at once: a sweep never deletes a chunk a session object names, even one
an upload found in the bucket just before the sweep deleted it. The upload reads the sweep's
lease before checking its chunks and again before writing the session object; a sweep waits
a few seconds after taking the lease before it lists. Against a real SeaweedFS."""
from __future__ import annotations

import threading
import time

from kvproxy.storage.chunks import manifest
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.shared import lease as leases
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation
from kvproxy.storage.shared.publish import (ALREADY_THERE, SWEEP_UNDER_WAY, WRITTEN, KnownChunks,
                                            publish, snapshot, unpublish)
from kvproxy.storage.shared.sweep import sweep
from kvproxy.storage.shared.sweeper import Sweeper
from kvproxy.storage.shared.uploader import Uploader
from kvproxy.storage.store import SessionStore
from tests.support import save_chunked

C = 16
TOKENS = list(range(100, 180))   # 5 chunks
HOUR = 3600.0


def lots_left() -> float:
    return HOUR


def chunk_names(bucket: Bucket, files: ChunkedFiles, stem: str) -> list[str]:
    keys = manifest.read_keys(files.store.chunked_path(stem))
    return [bucket.location.chunk("_", key) for key in keys]


def missing(bucket: Bucket, names: list[str]) -> list[str]:
    return [name for name in names if bucket.head(name) is None]


def orphaned(bucket: Bucket, files: ChunkedFiles, stem: str) -> bytes:
    """``stem`` uploaded, then its session object deleted (a conversation deleted on some
    node): its chunks are in the bucket and nothing names them. Returns the object."""
    assert publish(bucket, files, stem).outcome == WRITTEN
    stored = snapshot(files, stem).encode()
    unpublish(bucket, stem)
    return stored


class SweptAt(Bucket):
    """The real bucket, where another node runs a whole sweep (grace 0) just before this
    node's ``n``-th look at the sweep's lease."""

    def __init__(self, location, n: int):
        super().__init__(location, 5)
        self.looks, self.n, self.deleted = 0, n, ()

    def get(self, key):
        if key == self.location.lease(leases.SWEEP):
            self.looks += 1
            if self.looks == self.n:
                other = leases.Lease(Bucket(self.location, 5), leases.SWEEP, "other", 60)
                assert other.take()
                self.deleted = sweep(other.bucket, 0.0, lots_left).deleted_keys
                assert other.release()
        return super().get(key)


def test_an_upload_writes_nothing_while_another_node_sweeps(store_url, tmp_path):
    location = StoreLocation.parse(store_url)
    bucket = Bucket(location, 5)
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    save_chunked(files, "s", TOKENS)
    other = leases.Lease(Bucket(location, 5), leases.SWEEP, "other", 60)
    assert other.take()
    assert publish(bucket, files, "s").outcome == SWEEP_UNDER_WAY
    assert list(bucket.keys(location.user_prefix("_"))) == [], "no chunk, no session object"
    assert other.release()
    assert publish(bucket, files, "s").outcome == WRITTEN


def test_a_sweep_between_the_chunk_check_and_the_session_write_stops_that_write(
        store_url, tmp_path):
    """The same start of a conversation saved again after every conversation naming it was
    deleted: its chunks are in the bucket, unnamed and old. A sweep deletes them after the
    upload saw them there; the upload then writes no session object naming them, and its
    next try puts them back first."""
    location = StoreLocation.parse(store_url)
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    save_chunked(files, "gone", TOKENS)
    orphaned(Bucket(location, 5), files, "gone")
    save_chunked(files, "s", TOKENS + [1, 2, 3])
    bucket = SweptAt(location, n=2)   # the upload's second look, just before it writes
    known = KnownChunks()
    names = chunk_names(bucket, files, "s")
    assert publish(bucket, files, "s", known).outcome == SWEEP_UNDER_WAY
    assert set(names) <= set(bucket.deleted), "the sweep did delete the chunks the save names"
    assert bucket.head(location.session("_", "s")) is None
    done = publish(bucket, files, "s", known)
    assert done.outcome == WRITTEN and done.chunks == 5
    assert missing(bucket, names) == []


def test_a_session_object_written_as_a_sweep_begins_is_listed_by_it(store_url, tmp_path):
    """An upload that saw the lease free writes its session object a moment later (half a
    second: a sweep of this bucket is over sooner), after another node took the lease: the
    sweep waits before listing, so it sees the object."""
    location = StoreLocation.parse(store_url)
    bucket = Bucket(location, 5)
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    save_chunked(files, "s", TOKENS)
    stored = orphaned(bucket, files, "s")
    names = chunk_names(bucket, files, "s")
    sweeper = Sweeper(Bucket(location, 5), 0.0, 0, node="other", settle=3.0)
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(sweeper.run_once()))
    thread.start()
    deadline = time.monotonic() + 10
    while not leases.fence(bucket, leases.SWEEP).held:
        assert time.monotonic() < deadline, "the sweep never took its lease"
        time.sleep(0.02)
    time.sleep(0.5)
    assert bucket.replace(location.session("_", "s"), stored, None)
    thread.join(30)
    assert outcome and outcome[0].swept
    assert missing(bucket, names) == []


class LeaseTakenDuringWrite(Bucket):
    """The real bucket, where another node takes the sweep's lease while this node writes a
    session object (its write slower than the sweep's wait)."""

    def __init__(self, location):
        super().__init__(location, 5)
        self.other = leases.Lease(Bucket(location, 5), leases.SWEEP, "other", 60)

    def replace(self, key, body, etag, metadata=None):
        written = super().replace(key, body, etag, metadata)
        if "/sessions/" in key and self.other.left() == 0:
            assert self.other.take()
        return written


def test_a_session_written_as_a_sweep_began_has_its_chunks_checked_again(store_url, tmp_path):
    location = StoreLocation.parse(store_url)
    bucket = LeaseTakenDuringWrite(location)
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    save_chunked(files, "s", TOKENS)
    names = chunk_names(bucket, files, "s")
    uploader = Uploader(bucket)
    uploader.saved(files, "s")
    deadline = time.monotonic() + 20
    while bucket.head(location.session("_", "s")) is None:
        assert time.monotonic() < deadline, "never uploaded"
        time.sleep(0.05)
    bucket.delete(names[2])   # what that sweep might have deleted
    time.sleep(1.0)           # the recheck waits while the sweep holds the lease
    assert missing(bucket, names) == [names[2]]
    assert bucket.other.release()
    assert uploader.wait_idle(30)
    uploader.close()
    assert missing(bucket, names) == [], "the recheck put the chunk back"


def test_a_recheck_puts_back_only_what_is_missing(store_url, tmp_path):
    location = StoreLocation.parse(store_url)
    bucket = Bucket(location, 5)
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    save_chunked(files, "s", TOKENS)
    known = KnownChunks()
    assert publish(bucket, files, "s", known).outcome == WRITTEN
    names = chunk_names(bucket, files, "s")
    bucket.delete(names[0])
    assert publish(bucket, files, "s", known).outcome == ALREADY_THERE, "no recheck: not looked"
    assert missing(bucket, names) == [names[0]]
    known.under(leases.fence(bucket, leases.SWEEP))
    other = leases.Lease(bucket, leases.SWEEP, "other", 60)
    assert other.take() and other.release()   # a sweep ran: every chunk is looked at again
    done = publish(bucket, files, "s", known, recheck=True)
    assert (done.outcome, done.chunks) == (ALREADY_THERE, 1)
    assert missing(bucket, names) == []
