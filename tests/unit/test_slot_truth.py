"""A slot never holds what kvproxy's record says it does not (issue: one slot, one truth), on
the stubbed llama-server: a save that caught something else in the slot never becomes a
file, side requests run only while kvproxy holds every slot they could land in, concurrent
saves never share a temporary file, and eviction never deletes what is about to be used."""
from kvproxy.sessions.identity import Session
from kvproxy.slots.state import Phase
from tests.fake_llama import MODEL, make_switch
from tests.support import turn, metric

A = Session("A", "test", system_hash="aaaa", model=MODEL)
B = Session("B", "test", system_hash="bbbb", model=MODEL)


def intruder(fake, slot, tokens):
    """Something llama-server placed in ``slot`` itself (an embedding batch, an answer of a
    request's ``n``) between kvproxy's look at /slots and its save."""
    def land(_filename):
        fake.held[slot] = tokens
    fake.on_save = land


def test_a_save_behind_that_caught_something_else_is_not_installed(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake, 40)
    assert switch.save_settled(0) is True            # A's file holds its 40 tokens
    turn(switch, A, fake, 60)
    before = metric("kvproxy_saves_refused_total", kind="session")
    intruder(fake, 0, 7)
    assert switch.save_settled(0) is False
    sidecar = switch.store.read_sidecar(A.stem)
    assert sidecar["n_tokens"] == 40, "the file keeps A's last honest save"
    assert switch.store.bin_path(A.stem).stat().st_size == 4 + 40
    assert not list(tmp_path.glob("*.saving.bin")), "the caught save is discarded"
    assert switch.table.get(0).phase is Phase.UNPROVEN, "the slot is not trusted any more"
    assert metric("kvproxy_saves_refused_total", kind="session") == before + 1
    fake.on_save = None
    fake.actions.clear()
    lease = switch.acquire(A)
    assert (lease.cache, lease.restored_tokens) == ("restored", 40), "back from its file"
    switch.release(lease, {"cache_n": 40, "prompt_n": 5, "predicted_n": 0})


def test_a_swap_that_caught_something_else_keeps_the_old_file(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake, 40)
    intruder(fake, 0, 3)
    lease = switch.acquire(B)                         # saves A first: the save is refused
    switch.release(lease, {"cache_n": 0, "prompt_n": 30, "predicted_n": 0})
    assert not switch.store.has_bin(A.stem)
    assert switch.table.get(0).session_id == "B"


# -- side tasks ----------------------------------------------------------------------------
def test_a_side_task_is_leased_a_slot_holding_nothing_kept_else_a_saved_one():
    from kvproxy.slots.plan import side_slot
    from kvproxy.slots.state import SlotState
    unsaved = SlotState(Phase.UNSAVED, "A", "a", "a", True, None, 10, used_at="2026-01-01")
    saved_old = SlotState(Phase.OURS, "B", "b", "b", True, None, 10, used_at="2026-01-02")
    saved_new = SlotState(Phase.OURS, "C", "c", "c", True, None, 10, used_at="2026-01-03")
    assert side_slot({0: unsaved, 1: saved_new, 2: saved_old}, [0, 1, 2]) == 2
    assert side_slot({0: unsaved, 1: saved_new}, [0, 1, 2]) == 2, "slot 2 holds nothing"
    assert side_slot({0: unsaved}, [0]) == 0


def test_a_side_request_names_its_model_in_its_json_body_or_its_form():
    from flask import Flask
    from kvproxy.web.passthrough import _model_named
    app = Flask(__name__)
    with app.test_request_context("/v1/embeddings", method="POST",
                                  json={"model": "gemma", "input": "x"}):
        assert _model_named() == "gemma"
    with app.test_request_context("/v1/audio/transcriptions", method="POST",
                                  data={"model": "whisper", "file": (__import__("io").BytesIO(
                                      b"RIFF"), "a.wav")}):
        from flask import request
        assert _model_named() == "whisper"
        assert b"RIFF" in request.get_data(), "the form is still sent as it came"
    with app.test_request_context("/v1/rerank", method="POST", data=b"not json",
                                  content_type="application/json"):
        assert _model_named() is None


# -- saves and eviction --------------------------------------------------------------------
def test_two_slots_saving_one_file_never_share_its_temporary_file(tmp_path):
    """Two new conversations behind one new system prompt each make its base snapshot: the
    second save waits for the first instead of deleting or overwriting its temporary file."""
    import threading
    import time

    import responses as responses_lib

    from tests.fake_llama import FakeLlama
    with responses_lib.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake = FakeLlama(mock, tmp_path, n_slots=2)
        switch = make_switch(tmp_path, slots=2)
        fake.held[:] = [36, 36]
        made_by = switch.current_made_by()
        write = fake._slot_action
        second: list = []
        started = []

        def first_save_then_another(slot, action, filename):
            answer = write(slot, action, filename)
            if action == "save" and not second:
                worker = threading.Thread(target=lambda: second.append(switch.executor.save(
                    "base:cafe", "base.cafe", made_by, "base", "cafe", slot=1, tokens=36)))
                second.append(worker)
                worker.start()
                time.sleep(0.3)   # the other slot's save would run now, if it could
                started.extend(a for a in fake.slot_actions if a[0] == 1)
            return answer
        fake._slot_action = first_save_then_another
        dropped = metric("kvproxy_saves_dropped_total", kind="base")
        first = switch.executor.save("base:cafe", "base.cafe", made_by, "base", "cafe",
                                     slot=0, tokens=36)
        second[0].join(5)
    assert started == [], "the second save reached llama-server while the first was open"
    assert first is not None and second[1] is not None
    assert metric("kvproxy_saves_dropped_total", kind="base") == dropped
    assert switch.store.read_sidecar("base.cafe")["saved_from_slot"] == 1
    assert switch.store.bin_path("base.cafe").stat().st_size == 40
    assert not list(tmp_path.glob("*.saving.bin"))


def test_eviction_never_deletes_a_save_being_written(tmp_path, fake):
    switch = make_switch(tmp_path, max_disk_bytes=40)
    turn(switch, A, fake, 12)
    turn(switch, B, fake, 12)                     # A: 16 bytes
    writing = tmp_path / "other.saving.bin"       # another slot's save, not yet checked
    writing.write_bytes(bytes(20))
    turn(switch, A, fake, 12)                     # saving B needs room: A's file goes
    assert writing.exists(), "the other save would fail as if the folder were not llama-server's"
    assert switch.store.has_bin(B.stem)


def test_a_file_a_swap_is_about_to_restore_is_never_evicted(tmp_path, fake):
    """Eviction chooses and deletes under the lock with which swaps pin the files they may
    restore: a file pinned before eviction looks is spared."""
    switch = make_switch(tmp_path, max_disk_bytes=24)
    turn(switch, A, fake, 12)
    turn(switch, B, fake, 12)                     # A: 16 bytes, the oldest file
    C = Session("C", "test", model=MODEL)
    with switch.budget.pinned({A.stem}):          # another slot's swap to A has looked
        turn(switch, C, fake, 12)                 # saving B (16) wants A's room: pinned
        assert switch.store.has_bin(A.stem)
    assert switch.budget._pins == {}, "no pin outlives its swap"
    turn(switch, B, fake, 12)                     # saving C: A, unpinned now, is evicted
    assert not switch.store.has_bin(A.stem)
