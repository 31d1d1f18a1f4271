"""``python -m kvproxy`` against the app served in a thread (llama-server stubbed)."""
import json
import threading

import pytest
import responses
from werkzeug.serving import make_server

from kvproxy.ops import cli
from kvproxy import create_app
from tests.fake_llama import UPSTREAM, FakeLlama


@pytest.fixture(params=[1])
def served(request, tmp_path, monkeypatch):
    """kvproxy with an admin token on a local port; the CLI talks to it over HTTP. The
    parameter is llama-server's slot count (indirect parametrisation picks another)."""
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        FakeLlama(mock, tmp_path, n_slots=request.param)
        app = create_app({"slot_dir": str(tmp_path), "upstream": UPSTREAM,
                          "admin_token": "s3cret", "base_snapshots": False})
        server = make_server("127.0.0.1", 0, app, threaded=True)
        url = f"http://127.0.0.1:{server.server_port}"
        mock.add_passthru(url)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        monkeypatch.setenv("KVPROXY_ADMIN_TOKEN", "s3cret")
        monkeypatch.setenv("KVPROXY_URL", url)
        client = app.test_client()
        for session_id in ("alice", "bob"):
            client.post("/v1/chat/completions", headers={"X-Session-Id": session_id},
                        json={"messages": [{"role": "user", "content": "hi"}]})
        try:
            yield url
        finally:
            server.shutdown()
            thread.join(timeout=10)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ps_shows_the_slot_and_its_session(served, capsys):
    code, out, err = run(capsys, "ps")
    assert code == 0 and not err
    header, slot, llama = out.splitlines()
    assert header.split() == ["SLOT", "SESSION", "STATE", "TOKENS", "SINCE"]
    assert slot.split()[:3] == ["0", "bob", "idle"]
    assert llama.startswith("llama-server ok: tiny.gguf")
    code, out, _ = run(capsys, "ps", "--json")
    assert code == 0 and json.loads(out)["slots"][0]["session_id"] == "bob"


@pytest.mark.parametrize("served", [2], indirect=True)
def test_ps_shows_every_slot_and_clear_takes_one(served, capsys):
    code, out, err = run(capsys, "ps")
    assert code == 0 and not err
    header, *slots, llama = out.splitlines()
    assert [line.split()[:3] for line in slots] == [["0", "alice", "idle"], ["1", "bob", "idle"]]
    code, out, _ = run(capsys, "clear", "--slot", "1")
    assert (code, out) == (0, "slot 1 cleared (the sessions they held were saved first)\n")
    code, out, _ = run(capsys, "ps", "--json")
    assert [s["session_id"] for s in json.loads(out)["slots"]] == ["alice", "default"]
    code, out, err = run(capsys, "clear", "--slot", "7")
    assert code == cli.USAGE == 2 and not out
    assert err == "kvproxy: kvproxy refused the request: no slot 7: kvproxy drives slots [0, 1]\n"
    code, out, _ = run(capsys, "clear", "--json")
    assert code == 0 and json.loads(out)["slots"] == [0, 1]


def test_sessions_table_and_json(served, capsys):
    code, out, _ = run(capsys, "sessions")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["SESSION", "SIZE", "TOKENS"]
    assert [line.split()[0] for line in lines[1:]] == ["bob", "alice"]
    code, out, _ = run(capsys, "--json", "sessions")
    assert {s["id"] for s in json.loads(out)} == {"alice", "bob"}


def test_rm_then_rm_again_is_not_found(served, capsys):
    assert run(capsys, "rm", "alice")[:2] == (0, "deleted alice\n")
    code, out, err = run(capsys, "rm", "alice")
    assert code == cli.NOT_FOUND == 1 and not out
    assert err == "kvproxy: no saved session 'alice'\n"
    code, out, _ = run(capsys, "--json", "sessions")
    assert [s["id"] for s in json.loads(out)] == ["bob"]


def test_clear_empties_the_slot(served, capsys):
    code, out, _ = run(capsys, "clear", "--json")
    assert code == 0 and json.loads(out) == {"session_id": "default", "cleared": True, "slots": [0]}
    code, out, _ = run(capsys, "ps", "--json")
    assert json.loads(out)["slots"][0]["session_id"] == "default"


def test_stats(served, capsys):
    code, out, _ = run(capsys, "stats")
    assert code == 0
    assert "hit ratio     0.0% (hit 0, restored 0, base 0, miss 2)" in out
    assert "tokens        0 reused, 20 computed" in out
    assert "saved         2 sessions, 0 base snapshots" in out
    assert "restoring     on (0 unhonoured restores in a row)" in out
    data = json.loads(run(capsys, "stats", "--json")[1])
    assert data["stats"]["requests"] == 2
    assert data["disk"]["files"] == 1, "bob is in the slot, not saved yet"


def test_wrong_or_missing_token_is_exit_4(served, capsys, monkeypatch):
    monkeypatch.setenv("KVPROXY_ADMIN_TOKEN", "wrong")
    code, out, err = run(capsys, "ps")
    assert code == cli.AUTH == 4 and not out and err.count("\n") == 1 and "token" in err
    monkeypatch.delenv("KVPROXY_ADMIN_TOKEN")
    assert run(capsys, "rm", "alice")[0] == 4


def test_unreachable_is_exit_3(capsys):
    code, out, err = run(capsys, "--url", "http://127.0.0.1:9", "--timeout", "2", "ps")
    assert code == cli.UNREACHABLE == 3 and not out
    assert err == "kvproxy: cannot reach kvproxy at http://127.0.0.1:9: ConnectionError\n"


def test_something_else_than_kvproxy_is_exit_3(capsys):
    with responses.RequestsMock() as mock:
        mock.add(responses.GET, "http://other.test/api/status", body="<html>hello</html>")
        code, _, err = run(capsys, "--url", "http://other.test", "stats")
    assert code == 3 and "did not answer like kvproxy" in err


def test_busy_slot_is_exit_5(capsys):
    with responses.RequestsMock() as mock:
        mock.add(responses.POST, "http://k.test/api/sessions/clear", status=503,
                 json={"code": 503, "message": "the model is busy with another conversation"})
        code, _, err = run(capsys, "--url", "http://k.test", "clear")
    assert code == 5 and err.startswith("kvproxy: POST /api/sessions/clear: HTTP 503: the model is busy")


@pytest.mark.parametrize("argv", [[], ["bogus"], ["rm"], ["ps", "--nope"]])
def test_usage_errors_are_exit_2_in_one_line(capsys, argv):
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvproxy: usage error:") and err.count("\n") == 1


def test_rm_percent_encodes_ids(capsys):
    with responses.RequestsMock() as mock:
        mock.add(responses.DELETE, "http://k.test/api/sessions/a%2Fb%20c%3F", status=204)
        assert run(capsys, "--url", "http://k.test", "rm", "a/b c?")[0] == 0


def test_stats_say_how_sessions_are_stored():
    from kvproxy.ops.cli import stored_text
    assert stored_text({"chunks": 0}) == "as whole files"
    text = stored_text({"chunks": 12, "used_bytes": 3 * 1024**2, "logical_bytes": 12 * 1024**2,
                        "stored_ratio": 0.25, "written_per_save": 1024**2,
                        "logical_per_save": 6 * 1024**2})
    assert text.startswith("12 shared chunks") and "25.0%" in text and "a save wrote" in text


def test_sweep_without_a_shared_store_says_so(served, capsys):
    code, out, err = run(capsys, "sweep")
    assert code == cli.SERVER_ERROR and not out
    assert "KVPROXY_STORE_URL is not set" in err
