"""The shared store's size budget (KVPROXY_STORE_MAX_GB): a sweep over it evicts whole
conversations, the least recently saved first across every user, with the chunks no kept
conversation names. The decision is a pure function over the listing; the sweep runs against
a real SeaweedFS (``weed mini``)."""
from __future__ import annotations

import logging
import time

import pytest

from kvproxy.config import load_settings
from kvproxy.ops import cli
from kvproxy.sessions.identity import owner_tag
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.shared.bucket import Bucket, Listed
from kvproxy.storage.shared.location import StoreLocation
from kvproxy.storage.shared.publish import WRITTEN, publish
from kvproxy.storage.shared.sweep import sweep
from kvproxy.storage.shared.sweep_plan import StoredSession, evict
from kvproxy.storage.shared.sweeper import Sweeper
from kvproxy.storage.store import SessionStore
from tests.support import metric, save_chunked

C = 16
HOUR = 3600.0


# -- the decision (pure) ---------------------------------------------------------------
def chunk(key: str, size: int = 100) -> Listed:
    return Listed(key, size, '"e"', 0.0)


def session(key: str, saved: float, *names: str, size: int = 10) -> StoredSession:
    return StoredSession(key, size, saved, frozenset(names))


def test_a_bucket_within_its_budget_evicts_nothing():
    chunks = [chunk("c1"), chunk("c2")]
    sessions = [session("s1", 1, "c1"), session("s2", 2, "c2")]
    plan = evict(chunks, sessions, budget=220)   # exactly the bucket's bytes
    assert plan.sessions == () and plan.chunks == () and plan.freed == 0
    assert plan.remaining == 220


def test_budget_zero_is_no_budget():
    chunks = [chunk("c1", 10**9)]
    assert evict(chunks, [session("s1", 1, "c1")], budget=0).sessions == ()


def test_the_least_recently_saved_go_first_until_the_rest_fits():
    chunks = [chunk("old"), chunk("mid"), chunk("new")]
    sessions = [session("s-new", 3, "new"), session("s-old", 1, "old"),
                session("s-mid", 2, "mid")]
    plan = evict(chunks, sessions, budget=220)   # 330 stored: one conversation too many
    assert plan.sessions == ("s-old",) and plan.chunks == ("old",)
    assert (plan.freed, plan.remaining) == (110, 220)
    plan = evict(chunks, sessions, budget=219)
    assert plan.sessions == ("s-old", "s-mid") and plan.chunks == ("old", "mid")


def test_a_shared_chunk_counts_once_and_frees_only_with_its_last_conversation():
    chunks = [chunk("shared", 1000), chunk("a", 100), chunk("b", 100)]
    sessions = [session("s-a", 1, "shared", "a"), session("s-b", 2, "shared", "b")]
    # Counted once: 1,200 bytes of chunks and 20 of sessions.
    assert evict(chunks, sessions, budget=1220).sessions == ()
    plan = evict(chunks, sessions, budget=1219)
    assert plan.sessions == ("s-a",) and plan.chunks == ("a",) and plan.freed == 110
    plan = evict(chunks, sessions, budget=1000)
    assert plan.sessions == ("s-a", "s-b") and plan.chunks == ("a", "b", "shared")
    assert plan.freed == 1220 and plan.remaining == 0


def test_a_conversation_whose_chunks_a_kept_one_names_frees_only_its_session_object():
    chunks = [chunk("c1"), chunk("c2")]
    forked_off = session("s-prefix", 1, "c1", size=30)
    longer = session("s-longer", 2, "c1", "c2", size=30)
    plan = evict(chunks, [forked_off, longer], budget=250)
    assert plan.sessions == ("s-prefix",) and plan.chunks == () and plan.freed == 30


def test_unnamed_chunks_count_but_only_the_grace_rule_deletes_them():
    chunks = [chunk("young-unnamed"), chunk("old-unnamed"), chunk("c1")]
    sessions = [session("s1", 1, "c1")]
    plan = evict(chunks, sessions, budget=210, going={"old-unnamed"})
    assert plan.sessions == () and plan.remaining == 210, "what the grace rule deletes"
    plan = evict(chunks, sessions, budget=50, going={"old-unnamed"})
    assert plan.sessions == ("s1",) and plan.chunks == ("c1",)
    assert plan.remaining == 100, "the young unnamed chunk stays, even over the budget"


def test_a_session_to_keep_is_never_chosen_and_chunks_it_did_not_name_are_not_freed():
    chunks = [chunk("c1"), chunk("c2"), chunk("c3")]
    sessions = [session("s1", 1, "c1"), session("s2", 2, "c2"), session("s3", 3, "c3")]
    plan = evict(chunks, sessions, budget=100, keep={"s1"})
    assert plan.sessions == ("s2", "s3") and plan.chunks == ("c2", "c3")
    named_elsewhere = evict([chunk("c1")], [session("s1", 1, "c1", "missing")], budget=1)
    assert named_elsewhere.chunks == ("c1",), "a named chunk not in the listing is no bytes"


def test_the_setting_is_in_gigabytes_and_off_by_default():
    assert load_settings({}).store_max_gb == 0
    assert load_settings({"KVPROXY_STORE_MAX_GB": "2.5"}).store_max_gb == 2.5


def test_the_sweep_command_says_what_the_budget_evicted():
    class Answer:
        def __init__(self, body):
            self.body = body

        def json(self):
            return self.body

    class Client:
        def call(self, method, path):
            return Answer({"swept": True, "checked": 7, "deleted": 3, "freed_bytes": 3 * 1024,
                           "seconds": 0.5, "problem": None, "evicted": 2, "evicted_chunks": 3,
                           "evicted_bytes": 3 * 1024, "stored_bytes": 10 * 1024,
                           "budget_bytes": 8 * 1024})
    _, text = cli.cmd_sweep(Client(), None)
    assert text == ("swept: 7 chunks checked, 3 deleted, 3.0 KB freed in 0.50 s; 10.0 KB "
                    "stored, budget 8.0 KB: 2 conversation(s) evicted with 3 chunk(s), 3.0 KB")


# -- the sweep, against SeaweedFS -------------------------------------------------------
BOB = owner_tag("bob")
FIRST = list(range(100, 180))                       # 5 chunks
SECOND = list(range(300, 380))                      # 5 chunks of their own
THIRD = FIRST[:3 * C] + list(range(500, 532))       # 3 chunks shared with FIRST, 2 its own


def saved_at(hour: int) -> str:
    return f"2026-12-06T{hour:02d}:00:00.000+00:00"


@pytest.fixture
def three(store_url, tmp_path):
    """A bucket of three published conversations, saved in this order: ``first`` (no
    user's), ``second`` (bob's) and ``third`` (no user's; its first 3 chunks are first's),
    and the slot folder they were saved in."""
    bucket = Bucket(StoreLocation.parse(store_url), 5)
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    stems = {"first": "first", "second": f"{BOB}.second", "third": "third"}
    for hour, (name, tokens) in enumerate([("first", FIRST), ("second", SECOND),
                                           ("third", THIRD)], start=1):
        save_chunked(files, stems[name], tokens, saved_at(hour))
        assert publish(bucket, files, stems[name]).outcome == WRITTEN
    return bucket, files, stems


def contents(bucket: Bucket) -> dict[str, int]:
    where = bucket.location
    return {item.key: item.size for item in bucket.listing(where.users())
            if where.kind_of(item.key)}


def session_key(bucket: Bucket, stem: str) -> str:
    from kvproxy.storage.shared.location import user_of
    return bucket.location.session(user_of(stem), stem)


def chunk_keys(bucket: Bucket, stem: str) -> set[str]:
    from kvproxy.storage.shared.sweep import named_by
    return named_by(bucket, [Listed(session_key(bucket, stem), 0, "", 0.0)])


def lots_left() -> float:
    return HOUR


def test_a_bucket_over_budget_loses_its_oldest_conversations_and_only_their_chunks(three):
    bucket, files, stems = three
    before = contents(bucket)
    names = {name: chunk_keys(bucket, stem) for name, stem in stems.items()}
    assert len(names["first"] & names["third"]) == 3 and len(before) == 3 + 5 + 5 + 2
    kept = {session_key(bucket, stems["third"])} | names["third"]
    budget = sum(before[key] for key in kept)   # only the newest conversation fits
    done = sweep(bucket, HOUR, lots_left, budget=budget)
    after = contents(bucket)
    assert set(after) == kept, "nothing the kept conversation names goes"
    assert done.evicted == 2 and done.evicted_chunks == 2 + 5 == done.deleted
    assert done.evicted_bytes == done.freed == sum(before.values()) - budget
    assert done.stored == sum(before.values()) and done.problem is None
    assert files.store.chunked_path(stems["first"]).is_file(), "the local copy stays"
    # Its next save uploads it again, every chunk included.
    save_chunked(files, stems["first"], FIRST, saved_at(9))
    assert publish(bucket, files, stems["first"]).outcome == WRITTEN
    assert names["first"] <= set(contents(bucket))


def test_a_bucket_within_budget_loses_nothing(three):
    bucket, _, _ = three
    before = contents(bucket)
    done = sweep(bucket, HOUR, lots_left, budget=sum(before.values()))
    assert contents(bucket) == before and done.evicted == done.deleted == done.freed == 0
    assert sweep(bucket, HOUR, lots_left, budget=0).evicted == 0 and contents(bucket) == before


def test_the_oldest_goes_first_across_users_and_a_young_unnamed_chunk_stays(three):
    bucket, _, stems = three
    orphan = bucket.location.chunk("_", "ff" * 32)
    assert bucket.put_if_absent(orphan, b"x" * 100)
    before = contents(bucket)
    # One byte over: the oldest conversation (first) goes; its 2 chunks third does not name.
    done = sweep(bucket, HOUR, lots_left, budget=sum(before.values()) - 1)
    after = contents(bucket)
    assert session_key(bucket, stems["first"]) not in after
    assert session_key(bucket, stems["second"]) in after and orphan in after
    assert done.evicted == 1 and done.evicted_chunks == 2
    # Bob's conversation, saved second, goes next, before the newer one of no user.
    sweep(bucket, HOUR, lots_left, budget=sum(after.values()) - 1)
    assert session_key(bucket, stems["second"]) not in contents(bucket)
    assert session_key(bucket, stems["third"]) in contents(bucket)


class SavedMeanwhile(Bucket):
    """The real bucket, where ``stem`` is saved again (a newer turn, on another node) just
    before the sweep's ``nth`` look at one of its objects."""

    def __init__(self, bucket: Bucket, files, stem: str, on: str, nth: int = 1):
        super().__init__(bucket.location, 5)
        self.files, self.stem, self.on, self.nth, self.calls = files, stem, on, nth, 0

    def _maybe_save(self, call: str):
        if call == self.on:
            self.calls += 1
            if self.calls == self.nth:
                save_chunked(self.files, self.stem, FIRST + list(range(700, 716)),
                             saved_at(10))
                assert publish(self, self.files, self.stem).outcome == WRITTEN

    def listing(self, prefix):
        self._maybe_save("listing")
        return super().listing(prefix)

    def head(self, key):
        if key == session_key(self, self.stem):
            self._maybe_save("head")
        return super().head(key)


@pytest.mark.parametrize("on, nth", [("listing", 2), ("head", 1)],
                         ids=["before the second look", "just before its deletion"])
def test_a_conversation_saved_meanwhile_is_kept_with_its_chunks(three, on, nth):
    bucket, files, stems = three
    before = contents(bucket)
    meanwhile = SavedMeanwhile(bucket, files, stems["first"], on, nth)
    done = sweep(meanwhile, HOUR, lots_left, budget=sum(before.values()) - 1)
    after = contents(bucket)
    assert meanwhile.calls >= nth
    assert session_key(bucket, stems["first"]) in after
    assert chunk_keys(bucket, stems["first"]) <= set(after), "its session names no missing chunk"
    # Nothing else is taken in its place this time: the next sweep weighs the bucket again.
    assert done.evicted == 0 and done.deleted == 0
    assert session_key(bucket, stems["second"]) in after


def test_the_sweeper_keeps_the_budget_and_says_so(three, caplog):
    bucket, _, stems = three
    before = contents(bucket)
    sweeper = Sweeper(bucket, HOUR, 0, node="here", budget=sum(before.values()) - 1)
    evicted = metric("kvproxy_store_sweep_sessions_evicted_total")
    evicted_bytes = metric("kvproxy_store_sweep_evicted_bytes_total")
    with caplog.at_level(logging.INFO, logger="kvproxy.store"):
        outcome = sweeper.run_once()
    record = outcome.record()
    assert outcome.swept and record["evicted"] == 1 and record["evicted_chunks"] == 2
    assert record["stored_bytes"] == sum(before.values())
    assert record["budget_bytes"] == sum(before.values()) - 1
    assert metric("kvproxy_store_sweep_sessions_evicted_total") - evicted == 1
    assert metric("kvproxy_store_sweep_evicted_bytes_total") - evicted_bytes == \
        record["evicted_bytes"] > 0
    assert metric("kvproxy_store_sweep_stored_bytes") == sum(before.values())
    [line] = [r.getMessage() for r in caplog.records if "swept the shared store" in r.getMessage()]
    assert "1 conversation(s) evicted with 2 chunk(s)" in line
    assert session_key(bucket, stems["first"]) not in contents(bucket)


def test_the_budget_reaches_the_sweeper_from_the_settings(store_url):
    from kvproxy.storage.shared.store import SharedStore
    shared = SharedStore.of(load_settings({"KVPROXY_STORE_URL": store_url,
                                           "KVPROXY_STORE_MAX_GB": "0.5",
                                           "KVPROXY_STORE_SWEEP_MINUTES": "0"}))
    try:
        assert shared.sweeper.budget == 512 * 1024**2
        assert shared.sweep().record()["budget_bytes"] == 512 * 1024**2
    finally:
        shared.close()
