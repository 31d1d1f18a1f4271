"""make run supervises like a service manager (``python -m kvproxy.launch.serve``, as the
Makefile starts it): llama-server killed with SIGKILL is started again while kvproxy answers
503 with Retry-After, and the conversation comes back from its file; the gunicorn master
killed with SIGKILL leaves a worker whose exit save still reaches llama-server, which is
stopped only after it; no child outlives the command."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from kvproxy.launch.processes import REPO_ROOT, free_port, stop_process
from kvproxy.slots.restore_check import slot_file_tokens

pytestmark = pytest.mark.real


def children(pid: int) -> dict[int, str]:
    """The direct children of ``pid`` and their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout:.0f} s")


class Serve:
    def __init__(self, tmp: Path):
        self.port, self.llama_port = free_port(), free_port()
        self.slot_dir = tmp / "slots"
        self.out = tmp / "serve.out"
        env = {**os.environ, "KVPROXY_PORT": str(self.port), "LLAMA_PORT": str(self.llama_port),
               "KVPROXY_SLOT_DIR": str(self.slot_dir), "KVPROXY_LOG_DIR": str(tmp / "log"),
               "LLAMA_CACHE_RAM": "0", "KVPROXY_GRACEFUL_TIMEOUT": "30",
               "KVPROXY_LOCK_TIMEOUT": "60"}
        with open(self.out, "ab") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "kvproxy.launch.serve"],
                                            cwd=REPO_ROOT, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def child(self, word: str) -> int:
        return next(pid for pid, cmd in children(self.process.pid).items() if word in cmd)

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False


def chat(serve: Serve, session: str, messages: list[dict]) -> tuple[dict, requests.Response]:
    reply = requests.post(serve.url + "/v1/chat/completions", timeout=120,
                          headers={"X-Session-Id": session},
                          json={"messages": messages, "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json(), reply


def turn(serve: Serve, session: str, history: list[dict], question: str) -> requests.Response:
    history.append({"role": "user", "content": question})
    answer, reply = chat(serve, session, history)
    history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    return reply


def during_outage(serve: Serve, name: str) -> list[tuple[str, int, str | None]]:
    """One request per API: each is answered, 200 or 503 with Retry-After."""
    seen = []
    for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
            ("/v1/messages", {"model": "m", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi"}]}),
            ("/api/chat", {"model": name, "stream": False,
                           "messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/models", None), ("/api/tags", None)):
        reply = (requests.post(serve.url + path, json=body, timeout=60) if body
                 else requests.get(serve.url + path, timeout=60))
        seen.append((path, reply.status_code, reply.headers.get("Retry-After")))
    return seen


def test_make_run_restarts_llama_server_and_saves_before_stopping_it(tmp_path):
    serve = Serve(tmp_path)
    try:
        wait_for(serve.healthy, 180, "make run did not become healthy")
        hot = Path(re.search(r"hot copies of recent conversations in (\S+) ",
                             serve.output())[1])
        assert hot.is_dir() and str(hot).startswith("/dev/shm/"), hot
        llama_pid = serve.child("llama-server")
        name = requests.get(serve.url + "/api/tags", timeout=10).json()["models"][0]["name"]
        history: list[dict] = []
        turn(serve, "kept", history, "Name three colours.")
        turn(serve, "other", [], "Say hello.")                  # kept is saved to its file
        turn(serve, "kept", history, "Name three animals.")     # restored; this turn is unsaved

        # make run may start llama-server again before the first request of the outage is
        # sent: kill it again (at most three times) until a request lands in the outage.
        for kills in range(1, 4):
            os.kill(llama_pid, signal.SIGKILL)
            killed = time.monotonic()
            outage = during_outage(serve, name)
            print("during the outage:", outage)
            for path, status, retry_after in outage:
                assert status == 200 or (status == 503 and retry_after and int(retry_after) >= 1), \
                    (path, status)
            wait_for(lambda: serve.output().count("llama-server is back") >= kills, 120,
                     "llama-server was not started again")
            back = time.monotonic() - killed
            new_pid = serve.child("llama-server")
            assert new_pid != llama_pid and running(new_pid)
            llama_pid = new_pid
            if any(status == 503 for _, status, _ in outage):
                break
        assert any(status == 503 for _, status, _ in outage), "no request saw the outage"
        reply = turn(serve, "kept", history, "Name three trees.")
        assert reply.headers["X-KVProxy-Cache"] == "restored", reply.headers
        cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
        print(f"llama-server answered again {back:.1f} s after SIGKILL; the next turn "
              f"reused {cached} tokens from its file")

        last = turn(serve, "kept", history, "Name three rivers.")   # unsaved: in the slot only
        last_prompt = last.json()["usage"]["prompt_tokens"]
        entry = next(s for s in requests.get(serve.url + "/api/sessions", timeout=10).json()
                     if s["session_id"] == "kept")
        file = serve.slot_dir / entry["file"]
        before = len(slot_file_tokens(file))
        assert before < last_prompt, "the file already held the last turn"
        master = serve.child("gunicorn")
        worker = next(iter(children(master)))
        llama_pid = serve.child("llama-server")
        os.kill(master, signal.SIGKILL)
        serve.process.wait(120)
        assert serve.process.returncode == 1
        saved = len(slot_file_tokens(file))
        assert saved >= last_prompt, (f"the worker's exit save did not reach llama-server: the "
                                      f"file holds {saved} tokens, the last turn {last_prompt}")
        assert not running(worker) and not running(llama_pid), "a child outlived make run"
        assert not hot.exists(), "the run's hot copies outlived it"
        assert "Parent changed, shutting down" in serve.output()
    finally:
        stop_process(serve.process, 120)
        print(serve.output()[-3000:])
