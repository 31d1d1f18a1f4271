"""One view of llama-server: each reader's freshness, one cache (stubbed llama-server)."""
import responses

from kvproxy.upstream.llama import LlamaClient
from kvproxy.upstream.view import ServerView
from tests.support import Clock

URL = "http://llama.test"


def stubbed(mock):
    mock.get(URL + "/health", json={"status": "ok"})
    mock.get(URL + "/props", json={"model_path": "m.gguf"})
    mock.get(URL + "/v1/models", json={"data": [{"id": "m"}]})
    mock.get(URL + "/lora-adapters", json=[])
    mock.get(URL + "/slots", json=[{"id": 0}])


def asked(mock, path):
    return sum(1 for c in mock.calls if c.request.url.split("?")[0].endswith(path))


def test_props_are_reused_for_as_long_as_the_reader_allows():
    clock = Clock()
    view = ServerView(LlamaClient(URL), clock)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        stubbed(mock)
        view.props(10)
        clock.now = 5
        view.props(10)
        assert asked(mock, "/props") == 1
        view.props(2)
        assert asked(mock, "/props") == 2, "a reader that wants it fresher asks again"


def test_the_fingerprints_question_serves_the_other_readers():
    client = LlamaClient(URL)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        stubbed(mock)
        maker = client.view.ask_maker()
        assert maker.props == {"model_path": "m.gguf"} and maker.adapters == []
        client.view.props()
        client.view.entries()
        assert asked(mock, "/props") == 1 and asked(mock, "/v1/models") == 1


def test_the_fingerprint_is_reused_only_while_its_witness_is_open():
    client = LlamaClient(URL)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        stubbed(mock)
        maker = client.view.ask_maker()
    client.still_open = lambda witness: True
    assert client.view.proven(maker)
    client.still_open = lambda witness: False
    assert not client.view.proven(maker)
    client.view.forget_maker()
    assert client.view.maker() is None


def test_the_status_look_asks_every_time_and_never_raises():
    view = ServerView(LlamaClient("http://127.0.0.1:9", connect_timeout=1))
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.add_passthru("http://127.0.0.1:9")
        assert view.look().status == "unreachable"
    view = LlamaClient(URL).view
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        stubbed(mock)
        look = view.look()
        view.look()
        assert look.status == "ok" and look.slots == [{"id": 0}] and look.error is None
        assert asked(mock, "/props") == 2
        view.props()
        assert asked(mock, "/props") == 2, "what the look learned serves the others"


def test_the_status_look_is_not_the_clients_connection():
    client = LlamaClient(URL, api_key="k")
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        stubbed(mock)
        client.view.look()
        assert all(c.request.headers["Authorization"] == "Bearer k" for c in mock.calls)
    assert client.view._look_http is not client.http


def test_a_fresh_read_asks_now_and_serves_the_others():
    view = LlamaClient(URL).view
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        stubbed(mock)
        view.props()
        view.fresh_props()
        assert asked(mock, "/props") == 2, "the checks judge llama-server as it is now"
        view.props()
        assert asked(mock, "/props") == 2


def test_a_listing_read_of_a_model_behind_a_router_never_loads_it():
    view = LlamaClient(URL).for_model("m").view
    with responses.RequestsMock() as mock:
        mock.get(URL + "/props?model=m&autoload=false", json={"total_slots": 2})
        assert view.props(autoload=False) == {"total_slots": 2}
        assert view.props() == {"total_slots": 2}, "kept for the readers that would load it"
