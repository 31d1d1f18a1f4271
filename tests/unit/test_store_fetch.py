"""Fetch on miss: a conversation another node saved comes from the shared store into an empty
slot folder, chunks and all, and is put together byte for byte; only under the caller's own
user; a fetch that fails leaves nothing and says so in one line. Against a real SeaweedFS."""
from __future__ import annotations

import logging

import pytest

from kvproxy.launch.processes import free_port
from kvproxy.sessions.identity import Session, base_stem
from kvproxy.slots.answer import CountTokens
from kvproxy.slots.executor import SlotExecutor
from kvproxy.slots.state import SlotState
from kvproxy.storage.chunks import manifest
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.folder import FolderFiles
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.fetch import LEAST_DEADLINE, Race, fetch_or_compute
from kvproxy.storage.shared.location import StoreLocation, user_of
from kvproxy.storage.shared.publish import publish
from kvproxy.storage.shared.store import SharedStore
from kvproxy.storage.store import SessionStore
from kvproxy.telemetry.pace import Pace
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
    save_chunked(two, ALICE.stem, TOKENS, saved_at="2026-12-06T00:00:01.000+00:00")
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


# -- fetch or compute ---------------------------------------------------------------------
def test_while_either_pace_is_unknown_a_fetch_is_made_within_the_setting():
    assert fetch_or_compute(1000, 10 << 20, None, None, 30) == Race(True, 30)
    assert fetch_or_compute(1000, 10 << 20, 5.0, None, 30) == Race(True, 5.0)
    assert fetch_or_compute(1000, 10 << 20, None, 99.0, 30) == Race(True, 30)


def test_a_fetch_slower_than_computing_is_not_made_and_says_its_figures():
    race = fetch_or_compute(6000, 300 << 20, 4.0, 12.5, 30)
    assert not race.fetch
    assert race.why == (f"fetching {300 << 20} bytes would take about 12.5 s, computing its "
                        "6000 tokens about 4.0 s")


def test_a_fetch_may_take_as_long_as_computing_would_within_bounds():
    assert fetch_or_compute(6000, 1, 65.0, 1.4, 30) == Race(True, 30), "the setting caps it"
    assert fetch_or_compute(6000, 1, 8.0, 1.4, 30) == Race(True, 8.0)
    assert fetch_or_compute(50, 1, 0.1, 0.05, 30) == Race(True, LEAST_DEADLINE)


def test_a_pace_is_learnt_from_runs_long_enough_to_tell():
    pace = Pace(least_units=64)
    assert pace.rate() is None and pace.seconds_for(100) is None
    pace.note(10, 1.0)
    assert pace.rate() is None, "a short run tells no pace"
    pace.note(1000, 2.0)
    assert pace.rate() == 500 and pace.seconds_for(1500) == 3.0
    pace.note(1000, 1.0)
    assert 500 < pace.rate() < 1000, "recent runs move it, one run does not replace it"
    pace.note(1000, 0)
    assert 500 < pace.rate() < 1000


def test_a_fetch_slower_than_computing_the_prompt_leaves_nothing_and_says_why(nodes, caplog):
    one, two, shared = nodes
    save_chunked(one, ALICE.stem, TOKENS)
    publish(shared.bucket, one, ALICE.stem)
    quick_prefill = Pace()
    quick_prefill.note(1_000_000, 1.0)        # a million tokens a second
    shared.download.note(2 << 20, 100.0)      # 21 KB a second
    slower = metric("kvproxy_store_fetches_total", outcome="slower than computing")
    with caplog.at_level(logging.INFO, logger="kvproxy.store"):
        assert not two.fetch(ALICE.stem, quick_prefill)
    assert not two.has(ALICE.stem) and list(two.chunks.keys()) == []
    assert f"computing {ALICE.stem} instead of fetching it" in caplog.text
    assert f"computing its {len(TOKENS)} tokens" in caplog.text
    assert metric("kvproxy_store_fetches_total", outcome="slower than computing") - slower == 1
    slow_prefill = Pace()
    slow_prefill.note(100, 100.0)             # one token a second: fetching is quicker
    assert two.fetch(ALICE.stem, slow_prefill)
    assert restored(two, ALICE.stem) == slot_file(TOKENS)


def test_the_prefill_pace_is_learnt_from_answers_and_weighs_each_fetch(tmp_path):
    """llama-server's prompt timings of each answer teach the pace; a swap's fetch on miss is
    weighed with it."""
    asked = []

    class Folder(FolderFiles):
        def fetch(self, stem, prefill=None):
            asked.append((stem, prefill))
            return False
    store = SessionStore(tmp_path)
    executor = SlotExecutor(None, store, None, Folder(store))
    executor.perform(CountTokens(reused=0, computed=1000, computed_ms=2000.0))
    assert executor.memory.prefill.rate() == 500
    assert not executor.facts.file_facts("elsewhere", fetch=True).on_disk
    assert asked == [("elsewhere", executor.memory.prefill)]


class Fetching(FolderFiles):
    """A slot folder holding ``here``; records what the swap asks it to fetch."""

    def __init__(self, store, here=()):
        super().__init__(store)
        self.here, self.asked = set(here), []

    def has(self, stem):
        return stem in self.here

    def fetch(self, stem, prefill=None):
        self.asked.append(stem)
        return False


def swap_facts_of(tmp_path, session, here=()):
    store = SessionStore(tmp_path)
    files = Fetching(store, here)
    executor = SlotExecutor(None, store, None, files)
    executor.facts.swap_facts(0, SlotState(), session, "", {}, False, True, None, lambda stems: None)
    return files.asked


def test_without_its_own_file_a_conversation_fetches_its_seed_and_its_base(tmp_path):
    session = Session("new", "header", system_hash="s" * 16, seed="old-key", owner="alice",
                      model="m")
    assert swap_facts_of(tmp_path, session) == [session.stem, session.seed_stem,
                                                 base_stem(session.base_hash, "m")]
    assert swap_facts_of(tmp_path, session, here={session.seed_stem}) == [session.stem], \
        "a seed at hand: no base fetched"


def test_with_its_own_file_a_conversation_fetches_nothing_else(tmp_path):
    session = Session("new", "header", system_hash="s" * 16, seed="old-key", model="m")
    assert swap_facts_of(tmp_path, session, here={session.stem}) == []


def test_after_the_store_was_unreachable_lookups_pause_a_while(tmp_path, monkeypatch, caplog):
    """One request pays for finding the store down (boto3's tries), not every lookup of every
    request: the next ones compute at once, until the pause is over."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "kvproxy-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kvproxy-test-secret-value")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    now = [1000.0]
    shared = SharedStore(Bucket(StoreLocation("kv-store", "p"), 1), clock=lambda: now[0])
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C, shared=shared)
    failed = metric("kvproxy_store_fetches_total", outcome="failed")
    down = metric("kvproxy_store_fetches_total", outcome="store down")
    with caplog.at_level(logging.WARNING, logger="kvproxy.store"):
        assert not files.fetch(ALICE.stem)
        assert not files.fetch(BOB.stem) and not files.fetch("base.x")
    assert "(no lookups for 15 s)" in caplog.text
    assert metric("kvproxy_store_fetches_total", outcome="failed") - failed == 1
    assert metric("kvproxy_store_fetches_total", outcome="store down") - down == 2
    now[0] += 14.9
    assert not files.fetch(ALICE.stem)
    assert metric("kvproxy_store_fetches_total", outcome="store down") - down == 3
    now[0] += 0.2   # the pause is over: the next lookup tries the store again
    assert not files.fetch(ALICE.stem)
    assert metric("kvproxy_store_fetches_total", outcome="failed") - failed == 2
    shared.close()
