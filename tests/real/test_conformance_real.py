"""Differential conformance: every corpus request answered alike by llama-server and kvproxy.

The corpus is the hand-made edge cases in fixtures/conformance plus every
recorded client request in fixtures/recorded/<client>/. Each is sent to the
real llama-server directly and through the real kvproxy (gunicorn) in front of
it; the answers must have the same status class and the same form (see
tests/conformance.py), unless a row of its DIFFERENCES table says how they differ
(then exactly as it says). Ollama routes, which llama-server does not speak, must
answer 2xx through kvproxy.
"""
import pytest
import requests

from tests.conformance import differences, form_of, load_corpus
from tests.conftest import Stack

pytestmark = [pytest.mark.real, pytest.mark.timeout(1500)]

MAX_MESSAGES = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory, fim_model):
    """As conftest's stack, on the bundled model with FIM tokens named, so /infill answers."""
    # KVPROXY_MAX_MESSAGES lowered so that a corpus entry of a few messages shows the refusal
    started = Stack(tmp_path_factory.mktemp("stack"), model=fim_model,
                    KVPROXY_MAX_MESSAGES=str(MAX_MESSAGES)).start()
    yield started
    started.stop()


CORPUS = load_corpus()
TIMEOUT = (5, 600)  # the recorded Codex request is a 4,600-token prompt, prefilled on each side


def ask(base: str, entry) -> requests.Response:
    return requests.request(entry.method, base + entry.path, timeout=TIMEOUT,
                            **entry.request_kwargs())


def form(reply: requests.Response):
    return form_of(reply.status_code, reply.headers.get("Content-Type", ""), reply.text)


def test_corpus_is_not_empty():
    assert len(CORPUS) >= 50
    assert all(entry.path.startswith("/") for entry in CORPUS)


@pytest.mark.parametrize("entry", CORPUS, ids=[entry.name for entry in CORPUS])
def test_kvproxy_answers_as_llama_server_does(stack, entry):
    proxied_reply = None
    if not entry.direct:
        proxied_reply = ask(stack.url, entry)
        print(f"conformance {entry.name}: {proxied_reply.status_code} through kvproxy only")
        if entry.difference is not None:
            assert differences(None, form(proxied_reply), entry.difference) == []
            return
        expected = entry.expect.get("status", 2)
        assert proxied_reply.status_code // 100 == expected, proxied_reply.text[:500]
        return
    direct = form(ask(stack.llama.url, entry))
    proxied_reply = ask(stack.url, entry)
    proxied = form(proxied_reply)
    print(f"conformance {entry.name}: {direct.status} direct, {proxied.status} through kvproxy")
    if "status" in entry.expect:
        assert direct.status_class == entry.expect["status"], direct
    assert differences(direct, proxied, entry.difference) == [], proxied_reply.text[:500]
