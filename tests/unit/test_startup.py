"""Start-up checks against a stubbed llama-server: slot folder, slot saving, slot id."""
import time

import pytest
import responses

from kvproxy import create_app
from kvproxy.ops.startup import ContractError, check_at_start
from tests.fake_llama import UPSTREAM, FakeLlama


@pytest.fixture
def mock():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield mock


def make_app(slot_dir, **overrides):
    return create_app({"slot_dir": str(slot_dir), "upstream": UPSTREAM, **overrides})


def test_a_matching_llama_server_passes_and_leaves_no_probe(tmp_path, mock):
    fake = FakeLlama(mock, tmp_path)
    app = make_app(tmp_path)
    check_at_start(app)
    assert fake.actions and fake.actions[0][0] == "save" and fake.actions[0][1].startswith("probe.")
    assert not list(tmp_path.glob("probe.*"))
    health = app.test_client().get("/health")
    assert health.status_code == 200 and health.json["startup_check"] == "passed"


def test_a_different_slot_folder_stops_start_up_with_one_line(tmp_path, mock):
    FakeLlama(mock, tmp_path / "llama-writes-here")
    (tmp_path / "llama-writes-here").mkdir()
    with pytest.raises(ContractError) as caught:
        check_at_start(make_app(tmp_path / "kvproxy-reads-here"))
    message = str(caught.value)
    assert "outside KVPROXY_SLOT_DIR" in message and "--slot-save-path" in message
    assert "\n" not in message


def test_slot_saving_off_stops_start_up(tmp_path, mock):
    FakeLlama(mock, tmp_path).saving_off = True
    with pytest.raises(ContractError, match="slot saving off: start it with --slot-save-path"):
        check_at_start(make_app(tmp_path))


def test_a_llama_server_that_does_not_list_its_slots_stops_start_up(tmp_path, mock):
    """With --no-slots every slot would stay unproven: nothing saved, nothing ever a hit."""
    FakeLlama(mock, tmp_path).slots_off = True
    with pytest.raises(ContractError, match="started with --no-slots.*start it without"):
        check_at_start(make_app(tmp_path))


def test_a_slot_id_llama_server_does_not_have_stops_start_up(tmp_path, mock):
    fake = FakeLlama(mock, tmp_path)
    fake.props = {**fake.props, "total_slots": 2}
    with pytest.raises(ContractError, match="KVPROXY_SLOT_ID=2, but llama-server has 2 slot"):
        check_at_start(make_app(tmp_path, slot_id=2, slots=1))
    assert not fake.actions, "nothing is saved into a wrapped slot id"


def test_more_slots_than_llama_server_has_stops_start_up(tmp_path, mock):
    fake = FakeLlama(mock, tmp_path, n_slots=2)
    with pytest.raises(ContractError, match="KVPROXY_SLOTS=3, but llama-server has 2 slot.*-np 3"):
        check_at_start(make_app(tmp_path, slots=3))
    assert not fake.actions


def test_without_a_slot_count_kvproxy_drives_every_slot_llama_server_has(tmp_path, mock):
    FakeLlama(mock, tmp_path, n_slots=3)
    app = make_app(tmp_path)
    check_at_start(app)
    assert app.extensions["kvproxy.switch"].slot_ids() == [0, 1, 2]
    assert [s["id"] for s in app.test_client().get("/api/slots").get_json()] == [0, 1, 2]


def test_llama_server_down_at_start_then_health_reports_the_mismatch(tmp_path, mock, monkeypatch):
    monkeypatch.setattr("kvproxy.ops.startup.RECHECK_AFTER", 0)
    app = make_app(tmp_path / "kvproxy-reads-here")
    check_at_start(app)                       # llama-server does not answer: start anyway
    client = app.test_client()
    assert client.get("/health").status_code == 503
    FakeLlama(mock, tmp_path)                 # it comes up, writing into another folder
    deadline = time.monotonic() + 10
    reply = client.get("/health")
    while "outside KVPROXY_SLOT_DIR" not in (reply.json.get("error") or ""):
        assert time.monotonic() < deadline, reply.json
        time.sleep(0.05)
        reply = client.get("/health")
    assert reply.status_code == 503 and reply.json["status"] == "misconfigured"


def test_health_answers_at_once_while_the_slot_is_busy(tmp_path, mock, monkeypatch):
    """The lazy check never waits for the slot: a busy slot leaves it pending."""
    monkeypatch.setattr("kvproxy.ops.startup.RECHECK_AFTER", 0)
    FakeLlama(mock, tmp_path)
    app = make_app(tmp_path)
    switch = app.extensions["kvproxy.switch"]
    with switch.holding(1) as held:
        assert held
        started = time.monotonic()
        reply = app.test_client().get("/health")
        assert time.monotonic() - started < 1
    assert reply.status_code == 200 and reply.json["startup_check"] == "pending"
