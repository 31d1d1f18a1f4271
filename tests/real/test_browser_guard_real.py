"""A web page on another site, in a real browser (headless Chromium), cannot act for the
operator of a kvproxy without an admin token: its form POST, no-cors fetch and text/plain
chat are refused, while the status page's own buttons work (kvproxy.web.guard)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from kvproxy.launch.processes import free_port
from kvproxy.slots.restore_check import CHECK_FILE
from tests.conftest import Stack
from tests.status_page import ask, browser, slot_shows, wait_until  # noqa: F401 - fixture

pytestmark = pytest.mark.real

VICTIM = "csrf-victim-session"
OFF = {"another-llama-server": {"misses": 0, "off_since": "2026-01-01T00:00:00+00:00",
                                "off_until": "2999-01-01T00:00:00+00:00"}}

ATTACK = """<!doctype html><title>cute cats</title><iframe name="sink"></iframe><script>
async function attack(target) {
  const form = document.createElement("form");
  form.method = "POST"; form.action = target + "/api/sessions/clear"; form.target = "sink";
  const field = document.createElement("input");
  field.name = "slot"; field.value = "0"; form.appendChild(field);
  document.body.appendChild(form);
  const loaded = new Promise(done => document.querySelector("iframe").onload = done);
  form.submit();
  await loaded;
  await fetch(target + "/api/sessions/restore-check/reset", {method: "POST", mode: "no-cors"});
  await fetch(target + "/v1/chat/completions", {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "text/plain"},
    body: JSON.stringify({messages: [{role: "user", content: "I was here"}], max_tokens: 2,
                          user: "%s"})});
  await fetch(target + "/api/chat", {method: "POST", mode: "no-cors",
    body: JSON.stringify({model: "m", messages: [{role: "user", content: "hi"}], stream: false,
                          options: {num_predict: 2}, user: "%s"})});
  return "sent";
}
</script>""" % (VICTIM, VICTIM)


@pytest.fixture(scope="module")
def open_stack(tmp_path_factory):
    """llama-server plus kvproxy with the defaults: no admin token."""
    s = Stack(tmp_path_factory.mktemp("browser-guard")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def attacker_site():
    """A page on another site: http://localhost:<port>, while kvproxy is http://127.0.0.1."""
    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body = ATTACK.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://localhost:{server.server_address[1]}/"
    server.shutdown()
    thread.join(10)


def current(stack: Stack) -> dict:
    return requests.get(stack.url + "/api/sessions/current", timeout=30).json()


def saved(stack: Stack) -> set[str]:
    return {s["session_id"] for s in requests.get(stack.url + "/api/sessions", timeout=30).json()}


def test_a_page_on_another_site_cannot_act(open_stack, browser, attacker_site):  # noqa: F811
    ask(open_stack, "erin")
    check_file = open_stack.slot_dir / CHECK_FILE
    check_file.write_text(json.dumps(OFF))
    before = open_stack.proxy_log().count("status=403")

    page = browser.new_page()
    page.set_default_timeout(30000)
    page.goto(attacker_site)
    assert page.evaluate("target => attack(target)", open_stack.url) == "sent"
    page.close()

    # None took effect: the slot still holds erin, restoring is still off for the other
    # server, and no session of the page's choosing exists.
    assert current(open_stack)["session_id"] == "erin"
    assert json.loads(check_file.read_text()) == OFF
    assert VICTIM not in saved(open_stack) and current(open_stack)["session_id"] != VICTIM
    # Each reached kvproxy and was refused, rather than stopped by the browser.
    log = open_stack.proxy_log()
    assert log.count("status=403") - before == 4, log[-3000:]
    for path in ("/api/sessions/clear", "/api/sessions/restore-check/reset",
                 "/v1/chat/completions", "/api/chat"):
        assert f"path={path} status=403" in log, path


def test_the_status_pages_own_buttons_still_work(open_stack, browser):  # noqa: F811
    ask(open_stack, "frank")
    check_file = open_stack.slot_dir / CHECK_FILE
    check_file.write_text(json.dumps(OFF))
    page = browser.new_page()
    page.set_default_timeout(30000)
    page.goto(open_stack.url + "/status")
    slot_shows(page, "frank")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#slots button[data-action=clear]")
    slot_shows(page, "default")
    assert current(open_stack)["session_id"] == "default"
    shows_off = "document.getElementById('restore-check').textContent.includes('Switched off for 1 other')"
    wait_until(page, shows_off)
    page.click("#reset-restore-check")
    wait_until(page, "document.getElementById('message').textContent === 'Restore check reset.'")
    assert json.loads(check_file.read_text()) == {}
    page.close()


def test_a_foreign_host_name_is_refused(open_stack):
    """DNS rebinding: the browser of a page on attacker.example, whose name now points at
    kvproxy, sends that name as Host."""
    ask(open_stack, "alice@example.com")
    port = open_stack.proxy.port
    refused = requests.get(open_stack.url + "/api/sessions", timeout=30,
                           headers={"Host": f"attacker.example:{port}"})
    assert refused.status_code == 403
    assert "alice" not in refused.text and "KVPROXY_ALLOWED_HOSTS" in refused.json()["message"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        listed = requests.get(open_stack.url + "/api/sessions", timeout=30, headers={"Host": host})
        assert listed.status_code == 200 and "alice@example.com" in listed.text
