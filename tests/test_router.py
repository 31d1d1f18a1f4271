"""Router mode against stubs: which model a request names, and every call naming it."""
import json

import pytest
import responses

from kvproxy.errors import ClientError
from kvproxy.slots.models import ModelSwitches, is_loaded, pick_model
from kvproxy.upstream.llama import LlamaClient

ENTRIES = [{"id": "SmolLM2-135M-Instruct.Q4_1", "aliases": ["smol"],
            "status": {"value": "loaded"}},
           {"id": "gemma-3-270m-q4_k_m", "aliases": [], "status": {"value": "unloaded"}}]
URL = "http://router.test"


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
    def __init__(self, store=None, client=None):
        self.store, self.client, self.saved = store, client, []

    def checkpoint(self, timeout, unsaved_only=False):
        self.saved.append(unsaved_only)
        return True


def test_before_a_model_is_loaded_the_other_models_unsaved_turns_are_saved(tmp_path):
    default = FakeSwitch(type("S", (), {"root": tmp_path})())
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
