"""Side tasks llama-server does not pin (embeddings, rerank, decisions) on a stubbed
llama-server with two slots: the conversation of another idle slot is saved first and comes
back from its file when the task ran there; a slot another thread holds is waited for; a
burst saves once."""
import json
import logging
import threading

from dataclasses import replace

import pytest
import requests
import responses

from kvproxy import create_app
from kvproxy.sessions.identity import Session
from kvproxy.slots.plan import save_before_side, side_landed_in
from kvproxy.slots.state import Phase, SlotState, SlotTable
from kvproxy.storage.store import SessionStore
from tests.fake_llama import UPSTREAM, FakeLlama

# Each route with a body it accepts; llama-server reads id_slot for none of them.
SIDE_ROUTES = {
    "/v1/embeddings": {"input": ["one", "two"]},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"]},
    "/v1/systemone": {"questions": []},
    "/api/embed": {"model": "tiny", "input": "hello"},   # Ollama's, through relay.side_call
}
UPSTREAM_PATH = {"/api/embed": "/v1/embeddings"}


class UnpinnedTasks:
    """llama-server's side tasks on the stub: each lands in ``lands_in`` (default: the slot
    it was pinned to), whatever ``id_slot`` says, and leaves 3 tokens there."""

    def __init__(self, fake: FakeLlama):
        self.fake = fake
        self.lands_in: int | None = None
        self.ran: list[int] = []
        for path in ("/v1/embeddings", "/v1/rerank", "/v1/systemone"):
            fake.mock.add_callback(responses.POST, UPSTREAM + path, callback=self._task)

    def _task(self, request):
        body = json.loads(request.body)
        slot = self.lands_in if self.lands_in is not None else body.get("id_slot", 0)
        self.ran.append(slot)
        self.fake.held[slot] = 3
        self.fake.slot_actions.append((slot, "side-task", None))
        return self.fake._json({"data": [{"index": 0, "embedding": [1.0, 0.0]}],
                                "results": [], "answers": {}, "usage": {"prompt_tokens": 3}})


@pytest.fixture
def fake(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield FakeLlama(mock, tmp_path, n_slots=2)


@pytest.fixture
def tasks(fake):
    return UnpinnedTasks(fake)


@pytest.fixture
def app(tmp_path, fake):
    return create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 0.5,
                       "base_snapshots": False})


def chat(client, session):
    reply = client.post("/v1/chat/completions", headers={"X-Session-Id": session},
                        json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.get_data(as_text=True)
    return reply


def slot_of(tmp_path, session):
    return next(slot for slot, entry in SessionStore(tmp_path).read_table().items()
                if entry.get("active") == session)


def saves_of(fake, session_stem):
    return [(slot, name) for slot, action, name in fake.slot_actions
            if action == "save" and name.startswith(session_stem)]


def stem_of(tmp_path, session):
    return SessionStore(tmp_path).read_table()[slot_of(tmp_path, session)]["active_stem"]


# -- the decisions -----------------------------------------------------------------------
def test_only_a_proven_persistent_session_with_unsaved_turns_is_saved_first():
    held = SlotState(Phase.UNSAVED, session_id="A", key="A", persistent=True)
    assert save_before_side(held)
    assert not save_before_side(held.to(Phase.OURS)), "its file already matches"
    assert not save_before_side(replace(held, persistent=False)), "a side request"
    assert not save_before_side(held.to(Phase.UNPROVEN)), "never save an unproven slot"
    assert not save_before_side(SlotState()), "an empty slot"


def test_a_slot_whose_contents_changed_is_named_and_an_unchanged_one_is_not():
    ours = SlotState(Phase.OURS, tokens=12)
    table = {0: ours, 1: ours, 2: SlotState(Phase.UNPROVEN, tokens=5)}
    listing = [{"id": 0, "id_task": 7, "n_prompt_tokens": 11},     # the slot kept its turns
               {"id": 1, "id_task": 9, "n_prompt_tokens": 3},      # a side task ran there
               {"id": 2, "id_task": 9, "n_prompt_tokens": 3}]
    assert side_landed_in(table, listing, [0, 1, 2]) == [1]
    assert side_landed_in(table, [], [0]) == [0], "a slot /slots does not list is not trusted"
    unknown_first = {0: SlotState(Phase.UNPROVEN), 1: ours}
    assert side_landed_in(unknown_first, listing, [0, 1]) == [1], "the unproven slot is skipped"
    assert side_landed_in({0: SlotState()}, [{"id": 0}], [0]) == [], "an empty slot left empty"
    for odd in (None, {"error": "x"}, "slots"):
        assert side_landed_in(table, odd, [0, 1]) == [0, 1], f"/slots answered {odd!r}"


# -- the state table -----------------------------------------------------------------------
def test_a_slot_records_turns_its_file_lacks_until_a_save_or_a_restore(app, fake, tasks,
                                                                         tmp_path):
    client = app.test_client()
    chat(client, "A")
    table = SlotTable(SessionStore(tmp_path)).read
    assert table()[slot_of(tmp_path, "A")].phase is Phase.UNSAVED
    chat(client, "side-by-side")                 # the other slot
    chat(client, "C")                            # evicts A (least recently used): saved
    chat(client, "A")                            # restored from its file
    assert table()[slot_of(tmp_path, "A")].phase is Phase.UNSAVED, "A ran a turn after the restore"
    app.extensions["kvproxy.switch"].checkpoint()
    assert table()[slot_of(tmp_path, "A")].phase is Phase.OURS, "saved at shutdown"


# -- side tasks ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(SIDE_ROUTES))
def test_a_side_task_llama_server_runs_in_another_idle_slot_costs_that_conversation_nothing(
        path, app, fake, tasks, tmp_path, caplog):
    client = app.test_client()
    chat(client, "A")
    chat(client, "B")                            # A is now the least recently used
    slot_b = slot_of(tmp_path, "B")
    tasks.lands_in = slot_b                      # llama-server's pick, not kvproxy's lease
    with caplog.at_level(logging.INFO, logger="kvproxy.switch"):
        reply = client.post(path, json=SIDE_ROUTES[path])
    assert reply.status_code == 200, reply.get_data(as_text=True)
    assert tasks.ran == [slot_b]
    actions = [(slot, action) for slot, action, _ in fake.slot_actions if slot == slot_b]
    assert actions[-2:] == [(slot_b, "save"), (slot_b, "side-task")], \
        "B's newest turns were saved before the task overwrote its slot"
    assert f"llama-server ran the side request in slot {slot_b}" in caplog.text
    again = chat(client, "B")
    assert again.headers["X-KVProxy-Cache"] == "restored", "B came back from its file"
    assert saves_of(fake, stem_of(tmp_path, "B"))


def test_a_side_task_that_runs_where_it_was_pinned_leaves_the_other_slot_trusted(
        app, fake, tasks, tmp_path, caplog):
    client = app.test_client()
    chat(client, "A")
    chat(client, "B")
    with caplog.at_level(logging.INFO, logger="kvproxy.switch"):
        assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 200
    assert "ran the side request in slot" not in caplog.text
    assert chat(client, "B").headers["X-KVProxy-Cache"] == "hit"


def test_a_slot_that_cannot_be_saved_does_not_stop_the_next_one_being_saved(tmp_path):
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path, n_slots=3)
        UnpinnedTasks(fake)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "lock_timeout": 0.5,
                          "base_snapshots": False})
        client = app.test_client()
        for session in ("A", "B", "C"):
            chat(client, session)                # slots 0, 1, 2; A least recently used
        fake.held[slot_of(tmp_path, "B")] = 999  # another client used B's slot directly
        assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 200
        assert not saves_of(fake, stem_of(tmp_path, "B")), "never save a slot kvproxy cannot vouch for"
        assert saves_of(fake, stem_of(tmp_path, "C")), "the next slot is still saved"


def test_a_burst_of_side_tasks_saves_each_conversation_once(app, fake, tasks, tmp_path):
    client = app.test_client()
    chat(client, "A")
    chat(client, "B")
    for _ in range(4):
        assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 200
    assert len(saves_of(fake, stem_of(tmp_path, "B"))) == 1, "B's file already matched its slot"
    assert chat(client, "B").headers["X-KVProxy-Cache"] == "hit"


def test_a_side_task_waits_for_a_slot_another_thread_holds_and_runs_once_it_is_free(
        app, fake, tasks, tmp_path):
    """A slot another thread holds may be idle in llama-server (a background save, the
    moment between a restore and its answer, after an answer's last token): the task could
    land there, so it runs only once kvproxy holds every slot."""
    client = app.test_client()
    chat(client, "A")
    chat(client, "B")
    switch = app.extensions["kvproxy.switch"]
    entry = SessionStore(tmp_path).read_table()[slot_of(tmp_path, "B")]
    holder = switch.acquire(Session("B", "test", key=entry["active_key"]))  # B's turn holds it
    outcome = []
    side = threading.Thread(target=lambda: outcome.append(
        client.post("/v1/embeddings", json={"input": "x"}).status_code))
    side.start()
    side.join(0.2)
    assert outcome == [] and tasks.ran == [], "the task waits while B's slot is held"
    switch.release(holder)
    side.join(5)
    assert outcome == [200] and len(tasks.ran) == 1


def test_a_side_task_that_cannot_hold_every_slot_in_time_answers_503_and_runs_nowhere(
        app, fake, tasks, tmp_path):
    client = app.test_client()
    chat(client, "A")
    chat(client, "B")
    switch = app.extensions["kvproxy.switch"]
    entry = SessionStore(tmp_path).read_table()[slot_of(tmp_path, "B")]
    holder = switch.acquire(Session("B", "test", key=entry["active_key"]))
    try:
        reply = client.post("/v1/embeddings", json={"input": "x"})   # lock bound 0.5 s
        assert reply.status_code == 503 and reply.headers.get("Retry-After")
        assert tasks.ran == []
        assert switch.pool.busy_here() == {holder.slot}, "the slots it took are free again"
    finally:
        switch.release(holder)


def test_when_slots_cannot_be_read_after_the_task_every_held_slot_is_unproven(
        app, fake, tasks, tmp_path):
    client = app.test_client()
    chat(client, "A")
    chat(client, "B")
    honest = fake.slot_entry

    def after_the_task(slot=0):
        if tasks.ran:
            raise requests.ConnectionError("llama-server went away")
        return honest(slot)
    fake.slot_entry = after_the_task
    assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 200
    fake.slot_entry = honest
    assert SlotTable(SessionStore(tmp_path)).get(slot_of(tmp_path, "B")).phase is Phase.UNPROVEN
    assert chat(client, "B").headers["X-KVProxy-Cache"] == "restored"
