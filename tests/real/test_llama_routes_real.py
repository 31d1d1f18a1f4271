"""llama-server's own routes through kvproxy on the real llama-server, with real clients.

The Responses API is driven by the ``openai`` SDK (``client.responses``);
/infill is sent as llama.vscode sends it, to the bundled model with FIM tokens named:
hand-made, and as recorded from llama.vscode's own completion code
(tests/fixtures/recorded/llama-vscode, see its README).
"""
from pathlib import Path

import openai
import pytest
import requests

from tests.conftest import Stack, long_text
from tests.recorder import load_fixtures

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, fim_model):
    """As conftest's stack, on the bundled model with FIM tokens named, so /infill answers."""
    started = Stack(tmp_path_factory.mktemp("stack"), model=fim_model).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def first_turn(client, instructions, question, **kwargs):
    raw = client.responses.with_raw_response.create(
        model="any", instructions=instructions, input=question, max_output_tokens=8,
        temperature=0, **kwargs)
    return raw, raw.parse()


def next_turn(client, instructions, question, answer, follow_up, **kwargs):
    items = [{"role": "user", "content": question},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": answer}]},
             {"role": "user", "content": follow_up}]
    return client.responses.with_raw_response.create(
        model="any", instructions=instructions, input=items, max_output_tokens=8,
        temperature=0, **kwargs)


def streamed(raw):
    events = list(raw.parse())
    completed = [e for e in events if e.type == "response.completed"]
    assert events[0].type == "response.created" and len(completed) == 1
    return completed[0].response


def test_responses_keep_each_conversation_cached(client):
    """Two interleaved Responses conversations: each second turn is restored from its file."""
    sys_a, sys_b = long_text(300, 61), long_text(300, 62)
    raw_a, reply_a = first_turn(client, sys_a, "What is rule 1?")
    assert raw_a.headers["X-KVProxy-Cache"] in ("miss", "base")
    assert reply_a.object == "response" and reply_a.usage.input_tokens > 300
    raw_b = client.responses.with_raw_response.create(
        model="any", instructions=sys_b, input="What is rule 2?", max_output_tokens=8,
        temperature=0, stream=True)
    assert raw_b.headers["X-KVProxy-Session"] != raw_a.headers["X-KVProxy-Session"]
    reply_b = streamed(raw_b)

    again_a = next_turn(client, sys_a, "What is rule 1?", reply_a.output_text, "And rule 3?")
    assert again_a.headers["X-KVProxy-Cache"] == "restored"
    assert again_a.headers["X-KVProxy-Session"] == raw_a.headers["X-KVProxy-Session"]
    usage = again_a.parse().usage
    assert usage.input_tokens_details.cached_tokens > 300

    text_b = "".join(part.text for item in reply_b.output if item.type == "message"
                     for part in item.content)
    again_b = next_turn(client, sys_b, "What is rule 2?", text_b, "And rule 4?", stream=True)
    assert again_b.headers["X-KVProxy-Cache"] == "restored"
    assert streamed(again_b).usage.input_tokens_details.cached_tokens > 300


def test_responses_prompt_cache_key_names_the_session(client):
    raw, _ = first_turn(client, "Be brief.", "Hi.", prompt_cache_key="codex-session-9")
    assert raw.headers["X-KVProxy-Session"] == "codex-session-9"
    again, _ = first_turn(client, "Be brief.", "Something else.", prompt_cache_key="codex-session-9")
    assert again.headers["X-KVProxy-Cache"] == "hit"


def test_previous_response_id_is_answered_by_llama_server(client):
    """llama-server does not support it; the client hears llama-server's own refusal."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="any", input="Hi.", previous_response_id="resp_1",
                                max_output_tokens=4)
    assert "previous_response_id" in str(caught.value)


def infill_request(prefix):
    """What llama.vscode sends for one completion (src/llama-server.ts createRequestPayload)."""
    return {"input_prefix": prefix, "input_suffix": "\n\nif __name__ == '__main__':\n    main()\n",
            "input_extra": [{"filename": "helpers.py", "text": long_text(150, 71)},
                            {"filename": "models.py", "text": long_text(150, 72)}],
            "prompt": "    total = ", "n_predict": 8, "top_k": 40, "top_p": 0.99,
            "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 120000, "t_max_predict_ms": 3000}


def test_infill_reuses_the_editor_prefix(stack, client):
    prefix = "import sys\n\n\ndef main():\n    numbers = [1, 2, 3]\n"
    with requests.Session() as http:
        first = http.post(stack.url + "/infill", json=infill_request(prefix), timeout=120)
        assert first.status_code == 200, first.text
        assert first.headers["X-KVProxy-Session"] == "infill"
        prompt_tokens = first.json()["timings"]["prompt_n"] + first.json()["timings"]["cache_n"]
        assert prompt_tokens > 300
        second = http.post(stack.url + "/infill", json=infill_request(prefix + "    # sum\n"),
                           timeout=120)
        assert second.headers["X-KVProxy-Cache"] == "hit"
        assert second.json()["timings"]["cache_n"] > 0.9 * prompt_tokens
        # a chat in between takes the slot; the editor's prefix comes back from its file
        first_turn(client, "Be brief.", "Hi.")
        third = http.post(stack.url + "/infill", json=infill_request(prefix + "    # avg\n"),
                          timeout=120)
        assert third.headers["X-KVProxy-Cache"] == "restored"
        assert third.json()["timings"]["cache_n"] > 0.9 * prompt_tokens


def test_recorded_llama_vscode_completions_reuse_the_editor_session(stack):
    """Its ring-buffer update (n_predict 0) loads the project chunks; the completions
    after it, at two places in one file and the speculative one after an answer, run in
    the editor's session and read the chunks and the shared prefix from the slot."""
    recorded = load_fixtures(Path(__file__).parents[1] / "fixtures" / "recorded" / "llama-vscode")
    session = [r for r in recorded if "expect" not in r]
    assert session[0]["body"]["n_predict"] == 0 and len(session) == 4
    figures = []
    with requests.Session() as http:
        for record in session:
            body = {**record["body"], "n_predict": min(record["body"]["n_predict"], 8)}
            reply = http.post(stack.url + record["path"], json=body, headers=record["headers"],
                              timeout=120)
            assert reply.status_code == 200, reply.text[:500]
            assert reply.headers["X-KVProxy-Session"] == "infill"
            timings = reply.json()["timings"]
            figures.append((reply.headers["X-KVProxy-Cache"], timings["cache_n"],
                            timings["prompt_n"]))
    print(f"recorded llama.vscode (cache, cache_n, prompt_n): {figures}")
    assert [cache for cache, *_ in figures[1:]] == ["hit", "hit", "hit"]
    ring_update = figures[0][1] + figures[0][2]
    for _, cached, _computed in figures[1:]:
        # the project chunks are not computed again (only the tokens after them differ)
        assert cached > 0.95 * ring_update > 0
    # the speculative request is the one before it with the suggestion appended
    assert figures[3][1] > 0.9 * (figures[2][1] + figures[2][2])


def test_passthrough_routes_answer_as_llama_server(stack):
    with requests.Session() as http:
        props = http.get(stack.url + "/props", timeout=30)
        assert props.status_code == 200 and props.json()["total_slots"] == 1
        tokens = http.post(stack.url + "/tokenize", json={"content": "Hello"}, timeout=30).json()
        text = http.post(stack.url + "/detokenize", json=tokens, timeout=30).json()["content"]
        assert text.strip() == "Hello"
        count = http.post(stack.url + "/v1/chat/completions/input_tokens", timeout=30,
                          json={"messages": [{"role": "user", "content": "Hello"}]})
        direct = http.post(stack.llama.url + "/v1/chat/completions/input_tokens", timeout=30,
                           json={"messages": [{"role": "user", "content": "Hello"}]})
        assert count.status_code == direct.status_code and count.json() == direct.json()
        embeddings = http.post(stack.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
        no_embeddings = http.post(stack.llama.url + "/v1/embeddings", json={"input": "x"},
                                  timeout=30)
        assert embeddings.status_code == no_embeddings.status_code
        assert embeddings.json() == no_embeddings.json()
