"""Conversations without an id, followed by what they share with saved ones: the matching
rules from trails alone, and through the app against the llama-server stub."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import responses

from kvproxy import create_app
from kvproxy.sessions import matching
from kvproxy.relay import trails
from kvproxy.relay.trails import RESCAN_S, TrailIndex
from kvproxy.sessions.identity import Session
from kvproxy.storage.store import SIDECAR_FORMAT, SessionStore
from tests.fake_llama import UPSTREAM, FakeLlama
from tests.support import Clock

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 40}
EXAMPLES = [{"role": "user", "content": "Example question, with its worked answer. " * 60},
            {"role": "assistant", "content": "The example's answer, step by step. " * 60}]
MIN_CHARS = 512 * matching.CHARS_PER_TOKEN


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def record(messages, sid="conv-a", scope="s"):
    return matching.trail_of(messages).record(Session(sid, "conversation-hash"), scope)


def sidecar(path, trail):
    """A sidecar file of the current format recording ``trail``."""
    path.write_text(json.dumps({"format": SIDECAR_FORMAT, "stem": path.stem, "trail": trail}))


def test_canonical_holds_roles_text_and_tool_calls_and_the_trail_no_text():
    plain = [user("hi")]
    called = [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]
    assert matching.canonical(plain) != matching.canonical([assistant("hi")])
    assert matching.canonical(called) != matching.canonical([assistant("")])
    assert matching.canonical([user([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]) \
        == matching.canonical([user("ab")])
    trail = matching.trail_of([SYSTEM, user("secret words " * 100)])
    assert "secret" not in json.dumps(trail.record(Session("conv-x", "conversation-hash"), "s"))


def test_a_later_turn_continues_the_conversation_it_extends():
    turn1 = [SYSTEM, *EXAMPLES, user("What is a monad?")]
    saved = record(turn1)
    turn2 = turn1 + [assistant("A monoid in the category of endofunctors."), user("Simpler?")]
    found = matching.decide(matching.trail_of(turn2), [saved], MIN_CHARS)
    assert found.kind == matching.CONTINUE and found.record["id"] == "conv-a"
    same = matching.decide(matching.trail_of(turn1), [saved], MIN_CHARS)
    assert same.kind == matching.CONTINUE, "a resent or regenerated turn is the same conversation"


def test_a_part_moved_from_the_first_message_to_the_newest_keeps_the_conversation():
    body = {"type": "text", "text": "Please refactor this module. " * 300}
    reminder = {"type": "text", "text": "<system-reminder>Today is 2026-12-04.</system-reminder>" * 5}
    turn1 = [SYSTEM, user([body, reminder])]
    turn2 = [SYSTEM, user([body]), assistant("Done."), user([reminder, {"type": "text", "text": "next"}])]
    found = matching.decide(matching.trail_of(turn2), [record(turn1)], MIN_CHARS)
    assert found.kind == matching.CONTINUE


def test_a_new_chat_behind_the_same_examples_forks_instead_of_merging():
    chat_a = [SYSTEM, *EXAMPLES, user("First real question about ducks.")]
    chat_b = [SYSTEM, *EXAMPLES, user("Another question, about geese.")]
    found = matching.decide(matching.trail_of(chat_b), [record(chat_a)], MIN_CHARS)
    assert found.kind == matching.FORK
    edited = [SYSTEM, user("An edited first message. " * 200), assistant("ok"), user("more")]
    long_a = [SYSTEM, user("The original first message. " * 200), assistant("ok"), user("x")]
    assert matching.decide(matching.trail_of(edited), [record(long_a)], MIN_CHARS) is None \
        or matching.decide(matching.trail_of(edited), [record(long_a)], MIN_CHARS).kind == matching.FORK


def test_the_longest_shared_start_wins_and_short_ones_are_not_worth_it():
    chat_a = [SYSTEM, *EXAMPLES, user("ducks")]
    chat_b = [SYSTEM, *EXAMPLES, user("geese " * 200)]
    records = [record(chat_a, "conv-a"), record(chat_b, "conv-b")]
    later_b = chat_b + [assistant("honk"), user("and swans?")]
    found = matching.decide(matching.trail_of(later_b), records, MIN_CHARS)
    assert (found.kind, found.record["id"]) == (matching.CONTINUE, "conv-b")
    assert matching.decide(matching.trail_of(later_b), list(reversed(records)), MIN_CHARS) == found
    short = [user("hi there")]
    assert matching.decide(matching.trail_of(short + [assistant("x"), user("y")]),
                           [record(short)], MIN_CHARS) is None


def test_follow_forks_to_a_new_id_seeded_from_the_saved_conversation():
    chat_a = [SYSTEM, *EXAMPLES, user("ducks")]
    chat_b = [SYSTEM, *EXAMPLES, user("geese")]
    saved = record(chat_a, "conv-a")
    plain = Session("conv-a", "conversation-hash", system_hash="h")  # same first messages

    def rescope(session_id):
        return Session(session_id, "conversation-hash", system_hash="h")
    forked = matching.follow(plain, matching.trail_of(chat_b), [saved], "s", MIN_CHARS, rescope)
    assert forked.id != "conv-a" and forked.seed == "conv-a"
    assert forked.trail["id"] == forked.id and forked.trail["scope"] == "s"
    again = matching.follow(plain, matching.trail_of(chat_b), [saved], "s", MIN_CHARS, rescope)
    assert again.id == forked.id, "deterministic"
    later = matching.follow(plain, matching.trail_of(chat_b + [assistant("honk"), user("more")]),
                            [saved, forked.trail], "s", MIN_CHARS, rescope)
    assert later.id == forked.id and later.seed is None


def run_now(job):
    """A listing due is run at once, on the request's thread (the index's tests of what a
    listing shows; the background is tested on its own below)."""
    job()


def told_index(tmp_path, in_background=run_now):
    """A store, the trail index it tells of its sidecar writes and deletions, and the
    index's clock."""
    store, clock = SessionStore(tmp_path), Clock()
    index = TrailIndex(store, clock=clock, in_background=in_background)
    store.tell_sidecar_writes(index.learn, index.forget)
    return store, index, clock


def spied_reads(index, monkeypatch) -> list[str]:
    """The sidecars ``index`` reads from their files from now on, in order."""
    reads = []
    read = index._read
    monkeypatch.setattr(index, "_read", lambda name: reads.append(name) or read(name))
    return reads


def test_the_index_reads_only_its_scope_and_rereads_changed_sidecars(tmp_path):
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    sidecar(tmp_path / "a@m.json", record(chat, "conv-a", "mine"))
    sidecar(tmp_path / "b@m.json", record(chat, "conv-b", "theirs"))
    (tmp_path / "c@m.json").write_text("{not json")
    clock = Clock()
    index = TrailIndex(SessionStore(tmp_path), clock=clock, in_background=run_now)
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    sidecar(tmp_path / "a@m.json", record(chat, "conv-a2", "mine"))
    clock.now += RESCAN_S   # another process's write shows once the folder is listed again
    assert [r["id"] for r in index.records("mine")] == ["conv-a2"]


def test_the_index_lists_the_folder_at_most_once_a_rescan_and_learns_its_own_changes(
        tmp_path, monkeypatch):
    """Listing the folder is a stat per sidecar: done at most every ``RESCAN_S``; what this
    process writes or deletes in between shows at once, another process's write after it."""
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    ours, index, clock = told_index(tmp_path)
    listings = []
    files = ours.sidecar_files
    monkeypatch.setattr(ours, "sidecar_files", lambda: listings.append(1) or files())
    sidecar(tmp_path / "a@m.json", record(chat, "conv-a", "mine"))
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    sidecar(tmp_path / "b@m.json", record(chat, "conv-b", "mine"))   # another process's
    ours.update_sidecar("c@m", {}, trail=record(chat, "conv-c", "mine"))
    clock.now += RESCAN_S - 0.01
    assert sorted(r["id"] for r in index.records("mine")) == ["conv-a", "conv-c"]
    assert len(listings) == 1
    ours.delete("a@m")
    assert [r["id"] for r in index.records("mine")] == ["conv-c"]
    assert len(listings) == 1
    clock.now += 0.01
    assert sorted(r["id"] for r in index.records("mine")) == ["conv-b", "conv-c"]
    assert len(listings) == 2
    (tmp_path / "b@m.json").unlink()   # another process deletes it: gone at the next listing
    clock.now += RESCAN_S
    assert [r["id"] for r in index.records("mine")] == ["conv-c"]



def test_the_index_reads_a_sidecar_once_and_keeps_the_newest(tmp_path, monkeypatch):
    """Listing the folder again rereads only sidecars that changed; past ``MAX_RECORDS`` the
    newest sidecars are the ones compared with."""
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    clock = Clock()
    index = TrailIndex(SessionStore(tmp_path), clock=clock, in_background=run_now)
    reads = spied_reads(index, monkeypatch)
    sidecar(tmp_path / "a@m.json", record(chat, "conv-a", "mine"))
    os.utime(tmp_path / "a@m.json", ns=(1_000_000_000, 1_000_000_000))
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    clock.now += RESCAN_S
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    assert reads == ["a@m.json"]
    monkeypatch.setattr(trails, "MAX_RECORDS", 1)
    sidecar(tmp_path / "b@m.json", record(chat, "conv-b", "mine"))   # newer than a
    clock.now += RESCAN_S
    assert [r["id"] for r in index.records("mine")] == ["conv-b"]


def test_the_index_keeps_the_newest_notes(tmp_path, monkeypatch):
    """At most ``MAX_NOTES`` trails wait for their sidecars; one noted again is new again."""
    monkeypatch.setattr(trails, "MAX_NOTES", 2)
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    index = TrailIndex(SessionStore(tmp_path), clock=Clock(), in_background=run_now)
    for sid in ("conv-a", "conv-b", "conv-a", "conv-c"):
        index.note(record(chat, sid, "mine"))
    assert sorted(r["id"] for r in index.records("mine")) == ["conv-a", "conv-c"]
    index.note(None)
    index.note({"scope": "mine"})   # no id: nothing to wait for
    assert len(index.records("mine")) == 2


def test_the_index_takes_any_write_or_deletion_of_this_process(tmp_path):
    """A sidecar without a trail, and the deletion of one the index never saw, are taken
    in stride: the store's write or delete must not fail because an index listens."""
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    ours, index, _clock = told_index(tmp_path)
    ours.update_sidecar("a@m", {}, count="hits")
    assert index.records("mine") == []
    assert ours.delete("never@m") is False
    ours.update_sidecar("b@m", {}, trail=record(chat, "conv-b", "mine"))
    assert [r["id"] for r in index.records("mine")] == ["conv-b"]
    assert ours.delete("b@m") is True
    assert index.records("mine") == []


def test_the_index_takes_this_process_sidecar_writes_without_reading_them_back(tmp_path,
                                                                              monkeypatch):
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    ours, index, clock = told_index(tmp_path)
    reads = spied_reads(index, monkeypatch)
    ours.update_sidecar("a@m", {}, count="hits", trail=record(chat, "conv-a", "mine"))
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    assert reads == []
    # another process's store (this index is not told) rewrites it: read from the file
    theirs = SessionStore(tmp_path)
    theirs.update_sidecar("a@m", {}, count="hits", trail=record(chat, "conv-a2", "mine"))
    clock.now += RESCAN_S
    assert [r["id"] for r in index.records("mine")] == ["conv-a2"]
    assert reads == ["a@m.json"]


def test_the_index_knows_a_matched_request_before_its_sidecar_is_written(tmp_path):
    turn1 = [SYSTEM, *EXAMPLES, user("ducks")]
    turn2 = turn1 + [assistant("ok"), user("more")]
    index = TrailIndex(SessionStore(tmp_path), rescan_s=0,   # every change listed at once
                       in_background=run_now)
    index.note(record(turn1, "conv-a", "mine"))
    index.note(record(turn1, "conv-b", "theirs"))
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    # the sidecar still has the first turn while the second is in flight: the note wins
    sidecar(tmp_path / "a@m.json", record(turn1, "conv-a", "mine"))
    index.note(record(turn2, "conv-a", "mine"))
    assert [r["whole"] for r in index.records("mine")] == [record(turn2)["whole"]]
    # once the sidecar has it, the note is gone: a deleted conversation is forgotten
    sidecar(tmp_path / "a@m.json", record(turn2, "conv-a", "mine"))
    assert [r["whole"] for r in index.records("mine")] == [record(turn2)["whole"]]
    (tmp_path / "a@m.json").unlink()
    assert index.records("mine") == []


class Later:
    """Background listings held until the test runs them."""

    def __init__(self):
        self.jobs = []

    def __call__(self, job):
        self.jobs.append(job)

    def run(self):
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()


def test_a_due_listing_runs_in_the_background_and_requests_use_the_last_one(tmp_path,
                                                                           monkeypatch):
    """Only the first listing is a request's wait: a later one starts in the background
    (one at a time) while requests go on with the last listing."""
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    later = Later()
    ours, index, clock = told_index(tmp_path, in_background=later)
    listings = []
    files = ours.sidecar_files
    monkeypatch.setattr(ours, "sidecar_files", lambda: listings.append(1) or files())
    sidecar(tmp_path / "a@m.json", record(chat, "conv-a", "mine"))
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]   # the first: at once
    assert len(listings) == 1 and later.jobs == []
    sidecar(tmp_path / "b@m.json", record(chat, "conv-b", "mine"))   # another process's
    clock.now += RESCAN_S
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    assert len(later.jobs) == 1 and len(listings) == 1, "one listing at a time, not here"
    later.run()
    assert sorted(r["id"] for r in index.records("mine")) == ["conv-a", "conv-b"]
    assert len(listings) == 2 and later.jobs == [], "not due again yet"
    clock.now += RESCAN_S
    index.records("mine")
    assert len(later.jobs) == 1


def test_this_process_writes_change_the_grouping_in_place(tmp_path, monkeypatch):
    """A sidecar this process writes or deletes moves its record in the grouping: no
    request regroups the folder (a sort and a look at each of up to ``MAX_RECORDS``) for it."""
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    ours, index, _clock = told_index(tmp_path, in_background=Later())
    ours.update_sidecar("a@m", {}, trail=record(chat, "conv-a", "mine"))
    ours.update_sidecar("b@m", {}, trail=record(chat, "conv-b", "mine"))
    assert sorted(r["id"] for r in index.records("mine")) == ["conv-a", "conv-b"]
    groupings = []
    grouped = index._grouped
    monkeypatch.setattr(index, "_grouped", lambda *a: groupings.append(1) or grouped(*a))
    ours.update_sidecar("a@m", {}, trail=record(chat, "conv-a2", "theirs"))   # moved
    ours.update_sidecar("c@m", {}, trail=record(chat, "conv-c", "mine"))
    ours.update_sidecar("b@m", {}, trail=record(chat + [user("more")], "conv-b", "mine"))
    assert sorted(r["id"] for r in index.records("mine")) == ["conv-b", "conv-c"]
    assert [r["messages"] for r in index.records("mine") if r["id"] == "conv-b"] == \
        [len(chat) + 1]
    assert [r["id"] for r in index.records("theirs")] == ["conv-a2"]
    ours.delete("c@m")
    assert [r["id"] for r in index.records("mine")] == ["conv-b"]
    assert groupings == []


def test_a_request_that_comes_during_the_first_listing_waits_for_it(tmp_path, monkeypatch):
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    sidecar(tmp_path / "a@m.json", record(chat, "conv-a", "mine"))
    store = SessionStore(tmp_path)
    index = TrailIndex(store, clock=Clock(), in_background=Later())
    listing, go_on = threading.Event(), threading.Event()
    files = store.sidecar_files
    listings = []

    def slow_files():
        listings.append(1)
        listing.set()
        assert go_on.wait(10)
        return files()
    monkeypatch.setattr(store, "sidecar_files", slow_files)
    seen = {}
    first = threading.Thread(target=lambda: seen.update(first=index.records("mine")))
    first.start()
    assert listing.wait(10)
    second = threading.Thread(target=lambda: seen.update(second=index.records("mine")))
    second.start()
    second.join(0.2)
    assert second.is_alive(), "the second request waits for the first listing"
    go_on.set()
    first.join(10)
    second.join(10)
    assert [r["id"] for r in seen["first"]] == [r["id"] for r in seen["second"]] == ["conv-a"]
    assert len(listings) == 1, "and takes its listing rather than make another"


def test_a_listing_that_fails_is_made_again_when_due(tmp_path, monkeypatch):
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    later = Later()
    ours, index, clock = told_index(tmp_path, in_background=later)
    sidecar(tmp_path / "a@m.json", record(chat, "conv-a", "mine"))
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    files = ours.sidecar_files

    def broken():
        raise RuntimeError("a bug in the listing")
    monkeypatch.setattr(ours, "sidecar_files", broken)
    clock.now += RESCAN_S
    index.records("mine")
    with pytest.raises(RuntimeError):
        later.run()
    monkeypatch.setattr(ours, "sidecar_files", files)
    sidecar(tmp_path / "b@m.json", record(chat, "conv-b", "mine"))
    assert [r["id"] for r in index.records("mine")] == ["conv-a"], "the last listing serves"
    later.run()
    assert sorted(r["id"] for r in index.records("mine")) == ["conv-a", "conv-b"]


@pytest.mark.parametrize("during", ["scan", "grouping"])
@pytest.mark.parametrize("first", [True, False], ids=["first listing", "later listing"])
def test_what_this_process_writes_or_deletes_during_a_listing_is_laid_over_it(
        tmp_path, monkeypatch, first, during):
    """A listing may predate this process's writes and deletions made while it scans the
    folder or groups its records: the grouping taken shows a sidecar rewritten (its trail now
    another scope's) or written meanwhile, forgets it when it is deleted, and never brings
    back one deleted meanwhile."""
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    later = Later()
    ours, index, clock = told_index(tmp_path, in_background=later)
    ours.update_sidecar("a@m", {}, trail=record(chat, "conv-a", "mine"))
    ours.update_sidecar("d@m", {}, trail=record(chat, "conv-d", "mine"))
    if not first:
        assert sorted(r["id"] for r in index.records("mine")) == ["conv-a", "conv-d"]
    owner, method = (ours, "sidecar_files") if during == "scan" else (index, "_grouped")
    real = getattr(owner, method)

    def changes_meanwhile(*args):
        taken = real(*args)
        ours.update_sidecar("a@m", {}, trail=record(chat, "conv-a", "theirs"))
        ours.update_sidecar("b@m", {}, trail=record(chat, "conv-b", "mine"))
        ours.update_sidecar("c@m", {}, trail=record(chat, "conv-c", "mine"))
        ours.delete("c@m")   # never in the listing
        ours.delete("d@m")   # in the listing
        return taken
    monkeypatch.setattr(owner, method, changes_meanwhile)
    clock.now += RESCAN_S
    index.records("mine")
    later.run()
    monkeypatch.setattr(owner, method, real)
    assert [r["id"] for r in index.records("mine")] == ["conv-b"]
    assert [r["id"] for r in index.records("theirs")] == ["conv-a"]
    ours.delete("a@m")
    assert index.records("theirs") == []


def test_no_thread_for_a_listing_keeps_the_last_one_and_tries_again(tmp_path, caplog):
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    tries = []

    def no_thread(job):
        tries.append(job)
        raise RuntimeError("can't start new thread")
    ours, index, clock = told_index(tmp_path, in_background=no_thread)
    sidecar(tmp_path / "a@m.json", record(chat, "conv-a", "mine"))
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    clock.now += RESCAN_S
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    assert [r["id"] for r in index.records("mine")] == ["conv-a"]
    assert len(tries) == 2, "each request tries again"
    assert [r.getMessage() for r in caplog.records if r.name == "kvproxy.relay"] == [
        "the slot folder could not be listed in the background: can't start new thread"] * 2


def test_a_background_listing_runs_on_a_thread_and_its_failure_is_logged(caplog):
    """A daemon thread (a stop never waits for a listing), named for operators' tools."""
    ran, on = threading.Event(), []
    trails.on_a_thread(lambda: on.append(threading.current_thread()) or ran.set())
    assert ran.wait(10)
    assert on[0] is not threading.current_thread()
    assert on[0].daemon and on[0].name == "kvproxy-trail-listing"

    def fails():
        raise OSError("disk gone")
    threads = set(threading.enumerate())
    trails.on_a_thread(fails)
    for thread in set(threading.enumerate()) - threads:
        thread.join(10)
    logged = [r for r in caplog.records if r.name == "kvproxy.relay"]
    assert [r.getMessage() for r in logged] == ["listing the slot folder failed"]
    assert "disk gone" in str(logged[0].exc_info[1])


# -- through the app, against the stub --------------------------------------------------
@pytest.fixture
def app_and_fake(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 2,
                          "base_snapshots": False, "save_behind": False})
        yield app, fake


def chat(client, messages, agent="agent/1", **headers):
    reply = client.post("/v1/chat/completions", json={"messages": messages},
                        headers={"User-Agent": agent, **headers})
    assert reply.status_code == 200, reply.get_data(as_text=True)
    return reply.headers["X-KVProxy-Session"], reply.headers["X-KVProxy-Cache"]


def test_interleaved_chats_behind_the_same_examples_keep_their_own_sessions(app_and_fake):
    app, fake = app_and_fake
    client = app.test_client()
    chats = {name: [SYSTEM, *EXAMPLES, user(f"My real question is about {name}. " * 5)]
             for name in ("ducks", "geese", "swans")}
    first = {name: chat(client, msgs)[0] for name, msgs in chats.items()}
    assert len(set(first.values())) == 3, first
    restores = [a for a in fake.slot_actions if a[1] == "restore"]
    assert restores, "the second and third chats start from the first one's file"
    for turn in range(2):
        for name in chats:
            chats[name] += [assistant("ok"), user(f"turn {turn} of {name}")]
            session, cache = chat(client, chats[name])
            assert session == first[name]
            assert cache == "restored"
            assert fake.slot_actions[-1][1:] == ("restore", f"{_stem(app, session)}.bin")



def test_a_chat_sent_before_the_last_reply_was_recorded_still_forks(app_and_fake):
    # A client sends its next chat as soon as it has read the reply; kvproxy writes the
    # sidecar when the reply is closed, which may come later.
    import threading
    app, fake = app_and_fake
    client = app.test_client()
    a = [SYSTEM, *EXAMPLES, user("ducks")]
    b = [SYSTEM, *EXAMPLES, user("geese")]
    first = client.post("/v1/chat/completions", json={"messages": a},
                        headers={"User-Agent": "agent/1"}, buffered=False)
    assert first.status_code == 200
    first.get_data()  # read, not yet closed: no sidecar has its trail yet
    sidecars = Path(app.config["KVPROXY"].slot_dir).glob("*.json")
    assert not any("trail" in json.loads(path.read_text()) for path in sidecars)
    second = {}
    worker = threading.Thread(target=lambda: second.update(chat=chat(client, b)))
    worker.start()
    worker.join(0.5)  # it has its session and waits for the slot
    first.close()
    worker.join(10)
    assert second["chat"][0] != first.headers["X-KVProxy-Session"], "merged into the first chat"


def _stem(app, session_id):
    from pathlib import Path
    slot_dir = Path(app.config["KVPROXY"].slot_dir)
    found = [p.stem for p in slot_dir.glob("*.json")
             if json.loads(p.read_text()).get("session_id") == session_id]
    assert len(found) == 1, found
    return found[0]


def test_a_fork_never_saves_over_the_file_it_started_from(app_and_fake):
    app, fake = app_and_fake
    client = app.test_client()
    a = [SYSTEM, *EXAMPLES, user("ducks")]
    b = [SYSTEM, *EXAMPLES, user("geese")]
    sa, _ = chat(client, a)
    sb, cache = chat(client, b)
    assert sa != sb and cache == "restored"
    stem_a = _stem(app, sa)
    saves = [name for _, action, name in fake.slot_actions if action == "save"]
    assert [n for n in saves if n and n.startswith(stem_a)], "the first chat saved before the fork"
    chat(client, a + [assistant("ok"), user("more")])  # back to a: b is saved to its own file
    saves = [name for _, action, name in fake.slot_actions if action == "save"]
    assert any(n and n.startswith(_stem(app, sb)) for n in saves)
    assert sum(1 for n in saves if n and n.startswith(stem_a)) == 1


def test_another_client_never_follows_a_conversation_it_did_not_have(app_and_fake):
    app, fake = app_and_fake
    client = app.test_client()
    a = [SYSTEM, *EXAMPLES, user("ducks")]
    sa, _ = chat(client, a, agent="one")
    sb, cache = chat(client, a + [assistant("ok"), user("more")], agent="two")
    assert sa != sb
    assert not [x for x in fake.slot_actions if x[1] == "restore"], "nothing of the other client"


def test_matching_off_keeps_the_first_messages_key(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        FakeLlama(mock, tmp_path)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 2,
                          "base_snapshots": False, "save_behind": False, "match_min_tokens": 0})
        client = app.test_client()
        a = chat(client, [SYSTEM, *EXAMPLES, user("ducks")])[0]
        b = chat(client, [SYSTEM, *EXAMPLES, user("geese")])[0]
        assert a == b, "as before: keyed on the system prompt and first user message"


def test_short_conversations_keep_their_key_unless_another_already_has_it():
    plain = Session("conv-a", "conversation-hash")
    short = [user("hi"), ]
    saved = record(short, "conv-a")

    def rescope(session_id):
        return Session(session_id, "conversation-hash")
    again = matching.follow(plain, matching.trail_of(short + [assistant("x"), user("y")]),
                            [saved], "s", MIN_CHARS, rescope)
    assert again.id == "conv-a" and again.seed is None
    other = matching.follow(plain, matching.trail_of([user("hi"), assistant("z"), user("w")]),
                            [record(short + [assistant("x"), user("y")], "conv-a")], "s",
                            MIN_CHARS, rescope)
    assert other.id != "conv-a" and other.seed is None


def test_a_short_conversation_reshaped_on_a_later_turn_keeps_its_session():
    """Under the length worth a restore: a later turn whose first message lost a part keeps
    the session of its first messages' key, as before matching; a new chat of that key does
    not (a short fixed opening)."""
    first = user([{"type": "text", "text": "Fix the bug."},
                  {"type": "text", "text": "<system-reminder>today</system-reminder>"}])
    session = Session("conv-a", "conversation-hash", key="conv-a")
    saved = matching.trail_of([first]).record(session, "s")
    later = [user([{"type": "text", "text": "Fix the bug."}]), assistant("Done."),
             user("<system-reminder>today</system-reminder> and now?")]
    kept = matching.follow(session, matching.trail_of(later), [saved], "s", MIN_CHARS,
                           lambda sid: Session(sid, "conversation-hash", key=sid))
    assert kept.id == "conv-a" and kept.seed is None
    other = matching.follow(session, matching.trail_of([user("Fix the bug, another one.")]),
                            [saved], "s", MIN_CHARS,
                            lambda sid: Session(sid, "conversation-hash", key=sid))
    assert other.id != "conv-a"


def test_a_new_chat_sharing_only_the_system_prompt_starts_from_the_base_not_another_chat():
    """The base snapshot holds exactly the system prompt: no other conversation's file (and
    turns) is restored for a chat that shares nothing more."""
    long_system = {"role": "system", "content": "House rules, one by one. " * 400}
    one = [long_system, user("Chat one asks about rivers.")]
    saved = record(one, sid="conv-one")
    plain = Session("conv-two", "conversation-hash", key="conv-two")
    two = matching.follow(plain, matching.trail_of([long_system, user("Chat two asks.")]),
                          [saved], "s", MIN_CHARS,
                          lambda sid: Session(sid, "conversation-hash", key=sid))
    assert two.id == "conv-two" and two.seed is None


def test_the_index_reads_sidecars_through_the_store_older_formats_included(tmp_path):
    """A sidecar of an older kvproxy is migrated as the store reads it; a JSON file that is
    no sidecar (no format) records no trail."""
    chat = [SYSTEM, *EXAMPLES, user("ducks")]
    (tmp_path / "a@m.json").write_text(json.dumps({"format": 2, "stem": "a@m",
                                                   "trail": record(chat, "conv-a", "mine")}))
    (tmp_path / "b@m.json").write_text(json.dumps({"trail": record(chat, "conv-b", "mine")}))
    assert [r["id"] for r in TrailIndex(SessionStore(tmp_path)).records("mine")] == ["conv-a"]
