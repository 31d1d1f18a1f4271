"""The sweep of the shared store: chunks no session object names, older than the grace
period, deleted by one node at a time under a lease in the bucket. The decision is a pure
function; the lease and the sweep run against a real SeaweedFS (``weed mini``)."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from kvproxy import create_app
from kvproxy.errors import StoreError
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.shared.bucket import Bucket, Listed
from kvproxy.storage.shared.lease import Holder, Lease
from kvproxy.storage.shared.location import StoreLocation
from kvproxy.storage.shared.publish import publish
from kvproxy.storage.shared.sweep import sweep
from kvproxy.storage.shared.sweep_plan import doomed
from kvproxy.storage.shared.sweeper import Sweeper
from kvproxy.storage.store import SessionStore
from tests.fake_llama import UPSTREAM
from tests.support import metric, save_chunked

C = 16
TOKENS = list(range(100, 180))   # 5 chunks
HOUR = 3600.0
LATER = time.time() + 10 * HOUR  # a clock far enough on that every chunk is old


# -- the decision (pure) ---------------------------------------------------------------
def listed(key: str, age: float, now: float = 1e9, size: int = 10) -> Listed:
    return Listed(key, size, '"e"', now - age)


def test_only_unnamed_chunks_older_than_the_grace_are_doomed():
    chunks = [listed("named-old", 2 * HOUR), listed("unnamed-old", 2 * HOUR),
              listed("unnamed-young", 60), listed("named-young", 60)]
    chosen = doomed(chunks, {"named-old", "named-young"}, 1e9, HOUR)
    assert [c.key for c in chosen] == ["unnamed-old"]


def test_a_chunk_exactly_at_the_grace_stays_and_grace_zero_takes_every_unnamed_one():
    assert doomed([listed("a", HOUR)], set(), 1e9, HOUR) == []
    assert [c.key for c in doomed([listed("a", 0.5), listed("b", 0.5)], {"b"}, 1e9, 0)] == ["a"]


def test_nothing_listed_nothing_doomed():
    assert doomed([], {"x"}, 1e9, 0) == []


def test_object_names_tell_their_user_and_kind():
    where = StoreLocation("kv-store", "p")
    assert where.kind_of(where.chunk("alice-1a2b", "ab" * 32)) == ("alice-1a2b", "chunks")
    assert where.kind_of(where.session("_", "stem")) == ("_", "sessions")
    for other in (where.lease("sweep"), where.probe("x"), where.users() + "u/chunks/ab",
                  "elsewhere/users/_/sessions/s"):
        assert where.kind_of(other) is None
    assert StoreLocation("kv-store").lease("sweep") == "sweep.lease"


# -- the lease, against SeaweedFS -------------------------------------------------------
def bucket_of(store_url: str) -> Bucket:
    return Bucket(StoreLocation.parse(store_url), 5)


def test_of_sweepers_racing_for_the_lease_exactly_one_holds_it(store_url):
    bucket = bucket_of(store_url)
    leases = [Lease(bucket, "sweep", f"node-{n}", 60) for n in range(6)]
    start, won = threading.Barrier(len(leases)), []

    def race(lease):
        start.wait(10)
        if lease.take():
            won.append(lease.node)
    threads = [threading.Thread(target=race, args=(lease,)) for lease in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(won) == 1
    holder = Lease(bucket, "sweep", "late", 60)
    assert not holder.take() and holder.other.node == won[0]


def test_an_expired_lease_is_taken_over_and_its_old_holder_cannot_release_it(store_url):
    bucket = bucket_of(store_url)
    now = [time.time()]
    first = Lease(bucket, "sweep", "a", 60, clock=lambda: now[0])
    second = Lease(bucket, "sweep", "b", 60, clock=lambda: now[0])
    assert first.take() and not second.take() and second.other.node == "a"
    now[0] += 61   # a's lease ran out (a stalled node)
    assert second.take() and second.left() == pytest.approx(60)
    assert not first.release(), "a release never undoes another node's lease"
    assert not Lease(bucket, "sweep", "c", 60, clock=lambda: now[0]).take()
    assert second.release()
    assert Lease(bucket, "sweep", "c", 60, clock=lambda: now[0]).take(), "released: free"


def test_a_damaged_lease_does_not_stop_every_node(store_url):
    bucket = bucket_of(store_url)
    bucket.put(bucket.location.lease("sweep"), b"not json")
    assert Lease(bucket, "sweep", "a", 60).take()
    assert Holder("a", 1.5).encode() == b'{"node": "a", "expires": 1.5}'


# -- the sweep, against SeaweedFS -------------------------------------------------------
@pytest.fixture
def stocked(store_url, tmp_path):
    """A bucket holding one published session (5 chunks it names) and one chunk nothing
    names (a deleted conversation's)."""
    bucket = bucket_of(store_url)
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    save_chunked(files, "s", TOKENS)
    publish(bucket, files, "s")
    orphan = bucket.location.chunk("_", "ff" * 32)
    assert bucket.put_if_absent(orphan, b"x" * 100)
    return bucket, orphan


def chunk_names(bucket: Bucket) -> set[str]:
    where = bucket.location
    return {item.key for item in bucket.listing(where.users())
            if where.kind_of(item.key)[1] == "chunks"}


def lots_left() -> float:
    return HOUR


def test_an_unnamed_old_chunk_goes_and_named_ones_stay_however_old(stocked):
    bucket, orphan = stocked
    before = chunk_names(bucket)
    done = sweep(bucket, HOUR, lots_left, clock=lambda: LATER)
    assert done.checked == 6 and done.deleted == 1 and done.freed == 100
    assert done.deleted_keys == (orphan,) and done.problem is None
    assert chunk_names(bucket) == before - {orphan}


def test_an_unnamed_chunk_younger_than_the_grace_stays(stocked):
    bucket, orphan = stocked
    done = sweep(bucket, HOUR, lots_left)
    assert done.checked == 6 and done.deleted == 0 and orphan in chunk_names(bucket)
    time.sleep(1.2)   # the bucket's clock: LastModified ages for real
    assert sweep(bucket, 1.0, lots_left).deleted_keys == (orphan,)


class FailingLater(Bucket):
    """The real bucket, whose listings fail from the ``fail_from``-th on."""

    def __init__(self, location, fail_from: int):
        super().__init__(location, 5)
        self.fail_from, self.calls = fail_from, 0

    def listing(self, prefix):
        self.calls += 1
        if self.calls >= self.fail_from:
            raise StoreError("the shared store failed list: InternalError")
        return super().listing(prefix)


@pytest.mark.parametrize("fail_from", [1, 2])
def test_a_failing_listing_deletes_nothing(stocked, fail_from):
    bucket, orphan = stocked
    failing = FailingLater(bucket.location, fail_from)   # 2: the second look, just before deleting
    with pytest.raises(StoreError):
        sweep(failing, 0, lots_left, clock=lambda: LATER)
    assert orphan in chunk_names(bucket) and len(chunk_names(bucket)) == 6


def test_an_unreadable_session_object_deletes_nothing(stocked):
    bucket, orphan = stocked
    bucket.put(bucket.location.session("_", "damaged"), b"not a session object")
    with pytest.raises(StoreError, match="cannot read the session object"):
        sweep(bucket, 0, lots_left, clock=lambda: LATER)
    assert orphan in chunk_names(bucket)


def test_a_lease_running_low_stops_the_deletions(stocked):
    bucket, orphan = stocked
    done = sweep(bucket, 0, lambda: 1.0, clock=lambda: LATER)
    assert done.deleted == 0 and "lease" in done.problem and orphan in chunk_names(bucket)


def test_only_the_lease_holder_sweeps_and_each_sweep_is_one_line(stocked, caplog):
    bucket, orphan = stocked
    holder = Lease(bucket, "sweep", "elsewhere", 60)
    assert holder.take()
    sweeper = Sweeper(bucket, 0, 0, node="here", settle=0)
    skipped = metric("kvproxy_store_sweeps_total", outcome="leased elsewhere")
    outcome = sweeper.run_once()
    assert not outcome.swept and outcome.holder == "elsewhere"
    assert metric("kvproxy_store_sweeps_total", outcome="leased elsewhere") - skipped == 1
    assert orphan in chunk_names(bucket)
    holder.release()
    deleted = metric("kvproxy_store_sweep_chunks_deleted_total")
    with caplog.at_level(logging.INFO, logger="kvproxy.store"):
        outcome = sweeper.run_once()
    assert outcome.swept and outcome.record()["deleted"] == 1
    assert metric("kvproxy_store_sweep_chunks_deleted_total") - deleted == 1
    [line] = [r.getMessage() for r in caplog.records if "swept the shared store" in r.getMessage()]
    assert "6 chunk(s) checked, 1 deleted, 100 bytes freed" in line
    assert Lease(bucket, "sweep", "next", 60).take(), "the lease is released after a sweep"


def test_a_deleted_chunk_is_forgotten_by_this_nodes_uploader(stocked):
    from kvproxy.storage.shared.publish import KnownChunks
    bucket, orphan = stocked
    known = KnownChunks()
    known.add(orphan)
    Sweeper(bucket, 0, 0, node="here", known=known, settle=0).run_once()
    assert orphan not in known


# -- the admin action -------------------------------------------------------------------
def test_the_admin_action_sweeps_now_with_the_admin_token(store_url, tmp_path, fake):
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "store_url": store_url,
                      "admin_token": "t" * 20, "store_sweep_minutes": 0})
    client = app.test_client()
    assert client.post("/api/store/sweep").status_code == 401
    answer = client.post("/api/store/sweep", headers={"Authorization": "Bearer " + "t" * 20})
    assert answer.status_code == 200, answer.text
    assert answer.json["swept"] is True and answer.json["deleted"] == 0
    app.extensions["kvproxy.shared_store"].close()


def test_the_admin_action_without_a_store_says_so(tmp_path, fake):
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM})
    answer = app.test_client().post("/api/store/sweep")
    assert answer.status_code == 409 and "KVPROXY_STORE_URL" in answer.text


def test_a_chunk_seen_in_the_bucket_is_trusted_there_for_a_while_only():
    from kvproxy.storage.shared.publish import KnownChunks
    now = [0.0]
    known = KnownChunks(seconds=300, clock=lambda: now[0])
    known.add("c")
    now[0] = 299
    assert "c" in known
    now[0] = 301 + 299
    assert "c" not in known, "looked at again: a sweep elsewhere may have deleted it"


def test_the_sweep_command_prints_one_line(store_url, tmp_path, fake, capsys, monkeypatch):
    from werkzeug.serving import make_server
    from kvproxy.ops import cli
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "store_url": store_url,
                      "store_sweep_minutes": 0})
    server = make_server("127.0.0.1", 0, app, threaded=True)
    fake.mock.add_passthru(f"http://127.0.0.1:{server.server_port}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        code = cli.main(["--url", f"http://127.0.0.1:{server.server_port}", "sweep"])
    finally:
        server.shutdown()
        thread.join(10)
        app.extensions["kvproxy.shared_store"].close()
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("swept: 0 chunks checked, 0 deleted"), err
