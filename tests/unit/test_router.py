"""Router mode against stubs: which model a request names, and every call naming it."""
import json
from types import SimpleNamespace

import pytest
import responses

from kvproxy.errors import ClientError
from kvproxy.slots.models import ModelSwitches, is_loaded, pick_model
from kvproxy.storage.store import SessionStore
from kvproxy.upstream.llama import LlamaClient

ENTRIES = [{"id": "SmolLM2-135M-Instruct.Q4_1", "aliases": ["smol"],
            "status": {"value": "loaded"}},
           {"id": "gemma-3-270m-q4_k_m", "aliases": [], "status": {"value": "unloaded"}}]
URL = "http://router.test"
UPSTREAM_MODELS = "http://llama.test/v1/models"


@pytest.mark.parametrize("requested,expected", [
    ("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct.Q4_1"),
    ("smollm2-135m-instruct.q4_1:latest", "SmolLM2-135M-Instruct.Q4_1"),
    ("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-q4_k_m"),
    ("smol", "SmolLM2-135M-Instruct.Q4_1"),
    ("gpt-4", None), ("", None), (None, None), (7, None)])
def test_a_request_names_a_model_by_id_alias_tag_or_file_name(requested, expected):
    assert pick_model(requested, ENTRIES) == expected


def test_loaded_is_read_from_the_routers_status():
    assert is_loaded(ENTRIES[0]) and not is_loaded(ENTRIES[1]) and not is_loaded(None)


def test_every_model_and_slot_call_names_the_model_and_listings_never_load_it():
    client = LlamaClient(URL).for_model("gemma-3-270m-q4_k_m")
    with responses.RequestsMock() as mock:
        mock.get(URL + "/slots?model=gemma-3-270m-q4_k_m&autoload=false", json=[])
        mock.get(URL + "/props?model=gemma-3-270m-q4_k_m&autoload=false", json={})
        mock.post(URL + "/slots/0?action=save", json={"n_saved": 1})
        mock.post(URL + "/tokenize", json={"tokens": [1]})
        mock.get(URL + "/v1/models", json={"data": ENTRIES})
        client.slots()
        client.props(autoload=False)
        client.slot_action(0, "save", "a.bin")
        client.tokenize("hi")
        assert [e["id"] for e in client.models()["data"]] == ["gemma-3-270m-q4_k_m"]
        bodies = [json.loads(c.request.body) for c in mock.calls if c.request.body]
    assert [b["model"] for b in bodies] == ["gemma-3-270m-q4_k_m"] * 2
    assert client.still_open(("connection", "sock")) is False, \
        "the router's connection proves nothing of a model it may have unloaded"


class FakeSwitch:
    deletions = activity = None

    def __init__(self, store=None, client=None):
        self.store, self.client, self.saved = store, client, []
        self.budget = SimpleNamespace(dropped=None, share_pins=lambda other: None)

    def checkpoint(self, timeout, unsaved_only=False):
        self.saved.append(unsaved_only)
        return True


def test_before_a_model_is_loaded_the_other_models_unsaved_turns_are_saved(tmp_path):
    default = FakeSwitch(SessionStore(tmp_path))
    made = {}

    def make(client, store):
        made[client.model] = FakeSwitch(store, client)
        return made[client.model]
    models = ModelSwitches(LlamaClient(URL), default, make)
    with responses.RequestsMock() as mock:
        mock.get(URL + "/props", json={"role": "router"})
        mock.get(URL + "/v1/models", json={"data": ENTRIES})
        smol, client = models.route("smol")          # loaded: nothing to save first
        assert client.model == "SmolLM2-135M-Instruct.Q4_1" and made[client.model] is smol
        gemma, _ = models.route("gemma-3-270m-q4_k_m")  # not loaded: smol's turns saved
        assert smol.saved == [True] and gemma.saved == []
        assert gemma.store.state_file.name == ".kvproxy-state@gemma-3-270m-q4_k_m.json"
        with pytest.raises(ClientError) as refused:
            models.route("gpt-4")
    assert refused.value.status == 404 and "gemma-3-270m-q4_k_m" in refused.value.message


def router_over(tmp_path, fake, loaded=("m1", "m2")):
    """ModelSwitches in front of the stub posing as a router of models m1 and m2 (one slot
    each, which the stub shares: tests look at each model's table and calls)."""
    from kvproxy.slots.switch import SlotSwitch
    from tests.fake_llama import UPSTREAM, make_switch
    fake.props["role"] = "router"
    fake.models = {"data": [{"id": m, "status": {"value": "loaded" if m in loaded else
                                                  "unloaded"}} for m in ("m1", "m2")]}
    return ModelSwitches(LlamaClient(UPSTREAM), make_switch(tmp_path),
                         lambda client, store: SlotSwitch(client, store, base_snapshots=False))


def erases_by_model(fake):
    return [(json.loads(c.request.body).get("model"), "autoload=false" in c.request.url)
            for c in fake.mock.calls if "action=erase" in c.request.url]


def test_deleting_a_session_empties_its_slots_on_every_model_behind_a_router(tmp_path, fake):
    from kvproxy.sessions.identity import Session
    models = router_over(tmp_path, fake)
    for model in ("m1", "m2"):
        switch, _ = models.route(model)
        lease = switch.acquire(Session("A", "test", model=model))
        fake.held[0] = 20
        switch.release(lease, {"cache_n": 0, "prompt_n": 19, "predicted_n": 1})
        assert switch.checkpoint() is True          # A has a file on each model
    fake.mock.calls.reset()
    assert models.forget("A") is True
    assert sorted(erases_by_model(fake)) == [("m1", True), ("m2", True)], \
        "every model's slot erased, never loading a model for it"
    for model in ("m1", "m2"):
        assert models.switch_for(model).table.get(0).session_id == "default"
    assert not list(tmp_path.glob("A-*"))


def test_a_model_the_router_unloaded_is_not_loaded_to_forget_a_session(tmp_path, fake):
    """After a restart of kvproxy its state table still names the session: the slot is no
    longer trusted, and nothing is asked of the router for it."""
    from kvproxy.sessions.identity import Session
    models = router_over(tmp_path, fake)
    switch, _ = models.route("m2")
    lease = switch.acquire(Session("A", "test", model="m2"))
    switch.release(lease, {"cache_n": 0, "prompt_n": 19, "predicted_n": 1})
    restarted = router_over(tmp_path, fake, loaded=("m1",))
    fake.mock.calls.reset()
    restarted.forget("A")
    assert erases_by_model(fake) == []
    state = restarted.switch_for("m2").table.get(0)
    assert (state.session_id, state.phase.value) == ("default", "unproven")


def test_with_the_router_down_a_deleted_sessions_files_still_go(tmp_path, fake):
    from kvproxy.sessions.identity import Session
    models = router_over(tmp_path, fake)
    switch, _ = models.route("m1")
    lease = switch.acquire(Session("A", "test", model="m1"))
    fake.held[0] = 20
    switch.release(lease, {"cache_n": 0, "prompt_n": 19, "predicted_n": 1})
    assert switch.checkpoint() is True
    fake.mock.replace(responses.GET, UPSTREAM_MODELS, status=503)
    assert models.forget("A") is True and not list(tmp_path.glob("A-*"))
    assert switch.table.get(0).phase.value == "unproven"


def test_the_admin_delete_erases_the_slot_of_the_model_the_session_ran_on(tmp_path, fake):
    from kvproxy import create_app
    from tests.fake_llama import UPSTREAM
    router_over(tmp_path, fake)
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False})
    client = app.test_client()
    for model in ("m2", "m1", "m2"):   # back on m2: a hit (its slot holds the conversation)
        reply = client.post("/v1/chat/completions", headers={"X-Session-Id": "a"}, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200
    assert reply.headers["X-KVProxy-Cache"] == "hit"
    fake.mock.calls.reset()
    assert client.delete("/api/sessions/a").status_code == 204
    assert sorted(erases_by_model(fake)) == [("m1", True), ("m2", True)]
    reply = client.post("/v1/chat/completions", headers={"X-Session-Id": "a"}, json={
        "model": "m2", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.headers["X-KVProxy-Cache"] == "miss", "the deleted conversation came back"


def test_one_models_disk_budget_never_evicts_the_file_of_a_session_another_model_holds(
        tmp_path, fake):
    """Behind a router each model has its own switch and state table, in one slot folder."""
    from kvproxy.sessions.identity import Session
    from kvproxy.slots.switch import SlotSwitch
    from kvproxy.storage.store import SessionStore
    from tests.fake_llama import MODEL, UPSTREAM

    def on(model):
        return SlotSwitch(LlamaClient(UPSTREAM), SessionStore(tmp_path, model=model),
                          base_snapshots=False, max_disk_bytes=40)  # two 16-byte files

    def answer(switch, session_id):
        lease = switch.acquire(Session(session_id, "test", model=MODEL))
        fake.held[0] = 12
        switch.release(lease, {"cache_n": 0, "prompt_n": 11, "predicted_n": 1})
        return lease
    m1, m2 = on("m1"), on("m2")
    answer(m1, "A")
    assert m1.checkpoint() is True            # m1's slot holds A, the folder's oldest file
    for session_id in ("B", "C", "D"):        # m2 saves B, then C: room made for C
        answer(m2, session_id)
    assert sorted(p.name[0] for p in tmp_path.glob("*.bin")) == ["A", "C"], \
        "the file of the session m1's slot holds was evicted"


def test_the_admin_api_and_status_show_and_clear_every_models_slots(tmp_path, fake):
    from kvproxy import create_app
    from tests.fake_llama import UPSTREAM
    router_over(tmp_path, fake)
    app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM, "base_snapshots": False})
    client = app.test_client()
    for model in ("m1", "m2"):
        assert client.post("/v1/chat/completions", headers={"X-Session-Id": "a"}, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    rows = [(row["model"], row["id"], row["session_id"])
            for row in client.get("/api/slots").get_json()]
    assert rows == [("m1", 0, "a"), ("m2", 0, "a")]
    status = client.get("/api/status").get_json()
    assert [row["model"] for row in status["slots"]] == ["m1", "m2"]
    assert status["stats"]["requests"] == 2, "every model's requests are counted"
    fake.mock.calls.reset()
    assert client.post("/api/sessions/clear", json={}).get_json()["slots"] == [0, 0]
    assert sorted(m for m, _ in erases_by_model(fake)) == ["m1", "m2"]
    assert {row["session_id"] for row in client.get("/api/slots").get_json()} == {"default"}
