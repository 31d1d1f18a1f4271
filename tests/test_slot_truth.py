"""A slot never holds what kvproxy's record says it does not (issue: one slot, one truth), on
the stubbed llama-server: a save that caught something else in the slot never becomes a
file, side requests run only while kvproxy holds every slot they could land in, concurrent
saves never share a temporary file, and eviction never deletes what is about to be used."""
from kvproxy.sessions.identity import Session
from kvproxy.slots.state import Phase
from tests.fake_llama import MODEL, make_switch
from tests.test_save_behind import turn
from tests.test_switch_records import metric

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
