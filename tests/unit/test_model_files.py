"""Files carry their model: two models on one slot folder never write each other's files, and
files an older kvproxy saved without the model's tag are renamed to it at start-up."""
import json

from kvproxy.sessions.identity import Session, base_stem, file_stem, model_tag, on_model
from kvproxy.slots.switch import RESTORED
from kvproxy.storage import model_names
from kvproxy.storage.store import SIDECAR_FORMAT, SessionStore
from tests.fake_llama import MODEL, FakePrompt, make_switch, stem_of

A = Session("A", "test", system_hash="aaaa")
B = Session("B", "test", system_hash="aaaa")


def turn(switch, session, fake, tokens=40, prompt=None):
    lease = switch.acquire(session, prompt=prompt)
    fake.tokens = tokens
    switch.release(lease, {"cache_n": lease.restored_tokens,
                           "prompt_n": tokens - lease.restored_tokens, "predicted_n": 0})
    return lease


def test_model_tags_are_file_names_of_the_model():
    assert model_tag("/models/SmolLM2-135M-Instruct-Q8_0.gguf") == "SmolLM2-135M-Instruct-Q8_0"
    assert model_tag("ggml-org/gemma-3-270m-GGUF:Q4_K_M") == "gemma-3-270m-GGUF_Q4_K_M"
    assert model_tag("C:\\models\\a b.GGUF") == "a_b"
    assert model_tag(None) is None and model_tag("") is None
    assert model_tag("/models/..gguf") == "model"
    assert Session("x", "t").on_model("m").stem == f"{file_stem('x')}@m"
    assert base_stem("cafe", "m") == "base.cafe@m"


def test_a_session_and_its_base_are_saved_under_the_running_models_tag(tmp_path, fake):
    switch = make_switch(tmp_path, base_snapshots=True)
    prompt = FakePrompt(range(60), system=list(range(40)))
    lease = turn(switch, A, fake, prompt=prompt)
    assert lease.session.model == MODEL and lease.session.stem == stem_of("A")
    turn(switch, B, fake, prompt=prompt)
    names = {p.name for p in tmp_path.glob("*.bin")}
    assert names == {f"{stem_of('A')}.bin", f"base.aaaa@{MODEL}.bin"}, names
    sidecar = SessionStore(tmp_path).read_sidecar(stem_of("A"))
    assert sidecar["model"] == MODEL and sidecar["format"] == SIDECAR_FORMAT


def test_another_model_on_the_same_folder_keeps_the_first_models_files(tmp_path, fake):
    switch = make_switch(tmp_path)
    turn(switch, A, fake, tokens=40)
    turn(switch, B, fake)                          # A saved under the first model
    first = (tmp_path / f"{stem_of('A')}.bin").read_bytes()
    # llama-server restarted with another model: its slot is empty
    fake.props["model_path"] = "/models/other.gguf"
    fake.tokens = 0
    assert turn(switch, A, fake, tokens=25).cache != RESTORED, "another model's file is not used"
    turn(switch, B, fake)                          # A saved again, under the other model
    assert (tmp_path / f"{stem_of('A')}.bin").read_bytes() == first
    assert (tmp_path / f"{on_model(file_stem('A'), 'other')}.bin").is_file()
    # back to the first model: A comes back from its own file
    fake.props["model_path"] = "/models/tiny.gguf"
    fake.tokens = 0
    lease = turn(switch, A, fake)
    assert lease.cache == RESTORED and lease.restored_stem == stem_of("A")


def _old_pair(root, stem, made_by, n_bytes=8):
    (root / f"{stem}.bin").write_bytes(b"x" * n_bytes)
    (root / f"{stem}.json").write_text(json.dumps({
        "format": 2, "stem": stem, "session_id": "A", "kind": "session", "saved_at": "t",
        "saved_bytes": n_bytes, "made_by": made_by}))


def test_start_up_renames_untagged_files_to_their_models_tag(tmp_path):
    store = SessionStore(tmp_path)
    _old_pair(tmp_path, file_stem("A"), {"model_path": "/models/tiny.gguf"})
    _old_pair(tmp_path, "base.cafe", {"model_path": "/m/other.gguf"})
    (tmp_path / f"{file_stem('C')}.json").write_text(json.dumps(
        {"format": 2, "stem": file_stem("C"), "hits": 3}))     # never saved: stays
    store.write_state({"phase": "ours", "active": "A", "active_key": "A",
                       "active_stem": file_stem("A"), "slot_tokens": 8})
    done = model_names.tag_old_files(store)
    assert len(done) == 2
    names = {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")}
    assert names == {f"{stem_of('A')}.bin", f"{stem_of('A')}.json", "base.cafe@other.bin",
                     "base.cafe@other.json", f"{file_stem('C')}.json"}
    sidecar = store.read_sidecar(stem_of("A"))
    assert sidecar["stem"] == stem_of("A") and sidecar["model"] == MODEL
    assert sidecar["saved_bytes"] == 8
    assert store.read_state()["active_stem"] == stem_of("A")
    assert store.read_state()["model"] == MODEL
    assert model_names.tag_old_files(store) == [], "a second start renames nothing"


def test_a_rename_interrupted_after_the_new_sidecar_is_done_again(tmp_path):
    store = SessionStore(tmp_path)
    _old_pair(tmp_path, file_stem("A"), {"model_path": "/models/tiny.gguf"})
    # the crash came after the new sidecar was written, before the file was renamed
    (tmp_path / f"{stem_of('A')}.json").write_text((tmp_path / f"{file_stem('A')}.json")
                                                   .read_text())
    model_names.tag_old_files(store)
    assert (tmp_path / f"{stem_of('A')}.bin").read_bytes() == b"x" * 8
    assert not (tmp_path / f"{file_stem('A')}.bin").exists()
    assert store.read_sidecar(stem_of("A"))["stem"] == stem_of("A")
