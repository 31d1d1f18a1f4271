"""Fixtures: a real llama-server and kvproxy under gunicorn, each on a free port."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient

from kvproxy.launch.processes import LlamaServer, ProxyServer


class ClosingClient(FlaskClient):
    """A test client that closes each response as a WSGI server does once it is sent.

    kvproxy frees the slot when the server closes the response; Flask's client
    only does that for buffered responses, so buffering is the default here.
    """

    def open(self, *args, buffered: bool = True, **kwargs):
        return super().open(*args, buffered=buffered, **kwargs)


Flask.test_client_class = ClosingClient


class Stack:
    """llama-server plus kvproxy (gunicorn, as in production) over one slot folder;
    ``slots`` llama-server slots (``-np``), ``llama_args`` for anything else it takes."""

    def __init__(self, tmp: Path, model: str | None = None, slots: int = 1,
                 llama_args: dict | None = None, **proxy_env: str):
        self.slot_dir = tmp / "slots"
        self.log_dir = tmp
        self.llama = LlamaServer(str(self.slot_dir), model=model, slots=slots,
                                 log_path=str(tmp / "llama-server.log"), **(llama_args or {}))
        self.proxy = ProxyServer(self.llama.url, str(self.slot_dir),
                                 log_path=str(tmp / "proxy.log"),
                                 env={"KVPROXY_LOCK_TIMEOUT": "120", **proxy_env})

    @property
    def url(self) -> str:
        return self.proxy.url

    def start(self) -> "Stack":
        self.llama.start()
        try:
            self.proxy.start()
        except BaseException:
            self.stop()
            raise
        return self

    def start_proxy(self) -> None:
        self.proxy.start()

    def stop_proxy(self) -> None:
        self.proxy.stop()

    def stop(self) -> None:
        self.proxy.stop()
        self.llama.stop()

    def proxy_log(self) -> str:
        return (self.log_dir / "proxy.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A fresh llama-server and kvproxy for one test module."""
    s = Stack(tmp_path_factory.mktemp("stack")).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def fim_model(tmp_path_factory) -> str:
    """The bundled model with fill-in-the-middle tokens named (tests/fim_model.py)."""
    from tests.fim_model import make_fim_model
    return make_fim_model(tmp_path_factory.mktemp("fim-model"))


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


def started_weed(tmp_path_factory):
    """A real SeaweedFS (``weed mini``, kvproxy/launch/seaweed.py) in a folder of its own,
    yielded to a fixture and stopped after it (skipped when the binary is missing)."""
    from kvproxy.launch.seaweed import MISSING, WeedMini, weed_binary
    if weed_binary() is None:
        pytest.skip(MISSING)
    tmp = tmp_path_factory.mktemp("weed")
    server = WeedMini(tmp / "data", tmp / "weed.log").start()
    yield server
    server.stop(timeout=2)   # a throwaway store: weed's own orderly stop takes about 12 s


@pytest.fixture(scope="session")
def weed(tmp_path_factory):
    """One SeaweedFS for the whole run; each test takes a bucket of its own (``store_url``)."""
    yield from started_weed(tmp_path_factory)


@pytest.fixture
def store_url(weed, monkeypatch) -> str:
    """``KVPROXY_STORE_URL`` of a fresh bucket on the run's SeaweedFS, with boto3's own
    variables (endpoint, key) pointing at it as an operator would set them."""
    for name, value in weed.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    return f"s3://{weed.new_bucket()}/kv"


@pytest.fixture
def http():
    with requests.Session() as session:
        yield session


def count_tokens(stack: Stack, text: str) -> int:
    """Tokens of ``text`` by llama-server's own tokenizer (asked directly, not through kvproxy)."""
    reply = requests.post(stack.llama.url + "/tokenize", json={"content": text}, timeout=30)
    reply.raise_for_status()
    return len(reply.json()["tokens"])


@pytest.fixture(autouse=True)
def no_background_saves_in_unit_tests(request, monkeypatch):
    """Unit tests check the exact order of slot actions, which a background save after each
    answer would make depend on timing: they run without one (KVPROXY_SAVE_BEHIND), unless a
    test turns it on itself. Real and deployment tests run kvproxy as shipped."""
    if not any(request.node.get_closest_marker(m) for m in PROCESS_MARKERS):
        monkeypatch.setenv("KVPROXY_SAVE_BEHIND", "false")


@pytest.fixture
def fake(tmp_path):
    """The llama-server stub (tests/fake_llama.py) over a temporary slot folder; a test that
    needs it otherwise (more slots, extra routes) adjusts it or overrides this fixture."""
    import responses

    from tests.fake_llama import FakeLlama
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield FakeLlama(mock, tmp_path)


# -- folders follow markers -------------------------------------------------------------
PROCESS_MARKERS = ("real", "deploy")   # tests that start llama-server, gunicorn or nginx
TESTS = Path(__file__).resolve().parent


def folder_for(marks: set[str]) -> str:
    """The folder of tests/ for a test with these markers: ``deploy`` for the tests marked
    ``deploy`` (most also ``real``), ``real`` for the other tests marked ``real``, ``unit``
    for the rest."""
    if "deploy" in marks:
        return "deploy"
    return "real" if "real" in marks else "unit"


def misplaced(items: list[tuple[str, set[str]]]) -> list[str]:
    """Tests whose folder disagrees with their markers, so that a file's folder tells which
    set runs it. ``items``: (path inside tests/, marker names) per test."""
    wrong = []
    for path, marks in items:
        folder = folder_for(marks)
        if Path(path).parts[0] != folder:
            found = sorted(marks & set(PROCESS_MARKERS))
            why = f"marked {'/'.join(found)}" if found else "not marked real or deploy"
            wrong.append(f"{path} ({why}: belongs in tests/{folder}/)")
    return sorted(set(wrong))


def pytest_collection_modifyitems(config, items):
    wrong = misplaced([(item.path.resolve().relative_to(TESTS).as_posix(),
                        {m.name for m in item.iter_markers()}) for item in items])
    if wrong:
        raise pytest.UsageError("test files must sit in the folder of their markers (unit/: "
                                "neither, real/: real, deploy/: deploy): " + ", ".join(wrong))


_REAL_SEND = requests.adapters.HTTPAdapter.send


@pytest.fixture(autouse=True, scope="module")
def no_stub_left_behind():
    """After every test module, requests reach the network again: a `responses` stub left
    started would make every later real test's calls fail (llama-server "never" answering)."""
    yield
    assert requests.adapters.HTTPAdapter.send is _REAL_SEND, \
        "a test left a `responses` stub started (stop stubs in reverse order of starting)"
