"""gunicorn.conf.py behind a proxy: long streams survive the worker timeout, a stop lets the
running answer finish, and forwarded headers count only from the configured addresses.

Runs the repository's gunicorn.conf.py with a probe app (tests/gunicorn_probe.py) in place of
kvproxy, so the settings themselves are tested in seconds.
"""
import threading
import time

import pytest
import requests

from kvproxy.launch.processes import ProxyServer
from tests.nginx_harness import session_from

pytestmark = pytest.mark.deploy  # starts gunicorn processes: not part of the unit set


def probe(tmp_path, **env):
    return ProxyServer("http://127.0.0.1:9", str(tmp_path), log_path=str(tmp_path / "gunicorn.log"),
                       env=env, wsgi_app="tests.gunicorn_probe:app").start()


@pytest.fixture
def short_timeout(tmp_path):
    server = probe(tmp_path, KVPROXY_WORKER_TIMEOUT="3")
    yield server
    server.stop()


def test_worker_timeout_does_not_cut_a_long_stream(short_timeout):
    """A 7 s stream and a 7 s silent wait, with a worker timeout of 3 s."""
    reply = requests.get(short_timeout.url + "/stream?s=7", timeout=30)
    assert reply.status_code == 200 and reply.text.count("\n") == 28
    assert requests.get(short_timeout.url + "/slow?s=7", timeout=30).text == "done\n"
    log = (short_timeout.log_path and open(short_timeout.log_path).read()) or ""
    assert "WORKER TIMEOUT" not in log


@pytest.mark.parametrize("graceful, complete", [("30", True), ("1", False)])
def test_a_stop_lets_the_running_answer_finish(tmp_path, graceful, complete):
    """SIGTERM one second into a 4 s stream: within KVPROXY_GRACEFUL_TIMEOUT it ends cleanly;
    the short setting shows the test would see a cut answer."""
    server = probe(tmp_path, KVPROXY_GRACEFUL_TIMEOUT=graceful)
    try:
        timer = threading.Timer(1.0, server.stop)
        timer.start()
        lines, error = [], None
        try:
            with requests.get(server.url + "/stream?s=4", stream=True, timeout=30) as reply:
                for line in reply.iter_lines():
                    lines.append(line)
        except requests.RequestException as exc:
            error = exc
        timer.join(60)
        assert (len(lines) == 16 and error is None) is complete, (len(lines), error)
    finally:
        server.stop()


def test_forwarded_headers_count_only_from_the_configured_addresses(tmp_path):
    server = probe(tmp_path, KVPROXY_FORWARDED_ALLOW_IPS="127.0.0.2")
    try:
        https = {"X-Forwarded-Proto": "https"}
        with session_from("127.0.0.2") as trusted, session_from("127.0.0.3") as other:
            assert trusted.get(server.url + "/scheme", headers=https, timeout=10).text == "https"
            assert other.get(server.url + "/scheme", headers=https, timeout=10).text == "http"
        # 127.0.0.1 (gunicorn's own default) is not trusted once the setting names others.
        assert requests.get(server.url + "/scheme", headers=https, timeout=10).text == "http"
    finally:
        server.stop()


def test_forwarded_headers_default_to_a_proxy_on_this_machine(tmp_path):
    server = probe(tmp_path)
    try:
        https = {"X-Forwarded-Proto": "https"}
        assert requests.get(server.url + "/scheme", headers=https, timeout=10).text == "https"
        with session_from("127.0.0.3") as other:
            assert other.get(server.url + "/scheme", headers=https, timeout=10).text == "http"
    finally:
        server.stop()
