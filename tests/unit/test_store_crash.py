"""Crash points of an upload: a process killed (SIGKILL) at any step of copying a session to
the shared store never leaves a session object naming a missing chunk; the bucket keeps the
previous save whole, and the next upload completes it. Against a real SeaweedFS."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvproxy.launch.processes import REPO_ROOT
from kvproxy.storage.chunks import manifest
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.shared import session_object
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation
from kvproxy.storage.shared.publish import WRITTEN, publish
from kvproxy.storage.store import SessionStore
from tests.support import save_chunked

C = 16
FIRST = list(range(100, 180))                 # 5 chunks
SECOND = FIRST + list(range(300, 364))        # 4 more
LATER = "2026-12-06T00:00:05.000+00:00"

# Uploads ``stem`` of the slot folder, killing itself before its chunk write number ``after``
# (-1: before the session object, once every chunk is written).
CHILD = """
import os, signal, sys
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation
from kvproxy.storage.shared.publish import publish
from kvproxy.storage.store import SessionStore

slot_dir, url, stem, after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])


class Dying(Bucket):
    writes = 0

    def put_if_absent(self, key, body, metadata=None):
        if Dying.writes == after:
            os.kill(os.getpid(), signal.SIGKILL)
        Dying.writes += 1
        return super().put_if_absent(key, body, metadata)

    def replace(self, key, body, etag, metadata=None):
        if after < 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().replace(key, body, etag, metadata)


publish(Dying(StoreLocation.parse(url), 5), ChunkedFiles(SessionStore(slot_dir), chunk_tokens=16),
        stem)
print("published")
"""


def upload_killed(slot_dir, store_url: str, stem: str, after: int):
    return subprocess.run([sys.executable, "-c", CHILD, str(slot_dir), store_url, stem,
                           str(after)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


def stored_sessions(bucket: Bucket) -> dict[str, session_object.SessionObject]:
    found = {}
    for key, _ in bucket.keys(bucket.location.sessions("_")):
        found[key] = session_object.decode(bucket.get(key)[0])
    return found


def every_named_chunk_is_there(bucket: Bucket) -> bool:
    for stored in stored_sessions(bucket).values():
        for key in manifest.meta_of(stored.manifest)["keys"]:
            if bucket.head(bucket.location.chunk("_", key)) is None:
                return False
    return True


@pytest.mark.parametrize("after", [0, 2, -1])
def test_a_first_upload_killed_at_any_step_leaves_no_session_object(store_url, tmp_path, after):
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    save_chunked(files, "s", FIRST)
    result = upload_killed(tmp_path, store_url, "s", after)
    assert result.returncode == -9, result.stderr
    bucket = Bucket(StoreLocation.parse(store_url), 5)
    assert stored_sessions(bucket) == {}
    assert publish(bucket, files, "s").outcome == WRITTEN, "the next upload completes it"
    assert every_named_chunk_is_there(bucket) and len(stored_sessions(bucket)) == 1


@pytest.mark.parametrize("after", [0, 1, -1])
def test_a_next_turns_upload_killed_keeps_the_previous_save_whole(store_url, tmp_path, after):
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    bucket = Bucket(StoreLocation.parse(store_url), 5)
    save_chunked(files, "s", FIRST)
    publish(bucket, files, "s")
    first = session_object.generation_of(files.store.read_sidecar("s"))
    save_chunked(files, "s", SECOND, saved_at=LATER)
    result = upload_killed(tmp_path, store_url, "s", after)
    assert result.returncode == -9, result.stderr
    [stored] = stored_sessions(bucket).values()
    assert stored.generation == first and every_named_chunk_is_there(bucket)
    assert publish(bucket, files, "s").outcome == WRITTEN
    [stored] = stored_sessions(bucket).values()
    assert stored.generation == session_object.generation_of({"saved_at": LATER})
    assert every_named_chunk_is_there(bucket)
