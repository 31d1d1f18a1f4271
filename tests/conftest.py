"""Fixtures: a real llama-server and kvproxy under gunicorn, each on a free port."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from kvproxy.llama_process import LlamaServer, free_port, wait_until_healthy

ROOT = Path(__file__).resolve().parent.parent


class Stack:
    """llama-server plus kvproxy (gunicorn, as in production) over one slot folder."""

    def __init__(self, tmp: Path, **proxy_env: str):
        self.slot_dir = tmp / "slots"
        self.log_dir = tmp
        self.llama = LlamaServer(str(self.slot_dir), log_path=str(tmp / "llama-server.log"))
        self.port = free_port()
        self.proxy_env = proxy_env
        self.proxy: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Stack":
        self.llama.start()
        try:
            self.start_proxy()
        except BaseException:
            self.stop()
            raise
        return self

    def start_proxy(self) -> None:
        env = {**os.environ, "KVPROXY_UPSTREAM": self.llama.url,
               "KVPROXY_SLOT_DIR": str(self.slot_dir), "KVPROXY_PORT": str(self.port),
               "KVPROXY_LOCK_TIMEOUT": "120", **self.proxy_env}
        log = open(self.log_dir / "proxy.log", "ab")
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_until_healthy(self.url + "/health", 60, self.proxy)

    def stop_proxy(self) -> None:
        if self.proxy and self.proxy.poll() is None:
            self.proxy.send_signal(signal.SIGTERM)
            try:
                self.proxy.wait(40)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait(5)

    def restart_proxy(self) -> None:
        self.stop_proxy()
        self.start_proxy()

    def stop(self) -> None:
        self.stop_proxy()
        self.llama.stop()

    def proxy_log(self) -> str:
        return (self.log_dir / "proxy.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A fresh llama-server and kvproxy for one test module."""
    s = Stack(tmp_path_factory.mktemp("stack")).start()
    yield s
    s.stop()


def long_text(n_words: int, seed: int) -> str:
    """Deterministic prose of about 1.3 tokens a word, different for each seed."""
    rng = random.Random(seed)
    words = ["river", "lantern", "copper", "meadow", "signal", "harbor", "quiet", "orbit",
             "granite", "velvet", "thunder", "maple", "circuit", "falcon", "ember", "tide",
             "archive", "compass", "prism", "willow", "beacon", "glacier", "saddle", "cipher"]
    sentences = []
    while sum(len(s.split()) for s in sentences) < n_words:
        length = rng.randint(8, 16)
        sentence = " ".join(rng.choice(words) for _ in range(length))
        sentences.append(f"Rule {len(sentences) + 1}: {sentence.capitalize()}.")
    return f"Project {seed} handbook. " + " ".join(sentences)


@pytest.fixture
def http():
    with requests.Session() as session:
        yield session
