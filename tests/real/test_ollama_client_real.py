"""The real ``ollama`` Python client against kvproxy in front of a real llama-server."""
from __future__ import annotations

from datetime import datetime

import ollama
import pytest

from conftest import count_tokens, long_text

pytestmark = pytest.mark.real

SHORT = {"num_predict": 8, "temperature": 0, "seed": 1}


@pytest.fixture(scope="module")
def client(stack):
    return ollama.Client(host=stack.url, timeout=180)


@pytest.fixture(scope="module")
def model(client):
    names = [m.model for m in client.list().models]
    assert len(names) == 1 and names[0].endswith(":latest")
    return names[0]


def test_list_describes_the_served_gguf(client, model):
    entry = client.list().models[0]
    assert entry.size > 50_000_000 and len(entry.digest) == 64
    assert isinstance(entry.modified_at, datetime)
    assert entry.details.format == "gguf" and entry.details.family == "llama"
    assert entry.details.quantization_level == "Q4_1"
    assert entry.details.parameter_size.endswith("M")


def test_show_reads_the_gguf_header_and_template_caps(client, model):
    for name in (model, model.removesuffix(":latest")):
        info = client.show(name)
        assert info.modelinfo["general.architecture"] == "llama"
        assert info.modelinfo["llama.context_length"] == 8192
        # SmolLM2's template has no tools or thinking and llama-server reports no vision
        assert info.capabilities == ["completion"]
        assert "<|im_start|>" in info.template


def test_ps_lists_the_loaded_model(client, model):
    entry = client.ps().models[0]
    assert entry.model == model and entry.context_length == 8192
    assert isinstance(entry.expires_at, datetime)


def test_chat_whole_and_streamed(client, model):
    messages = [{"role": "user", "content": "Name one colour."}]
    whole = client.chat(model=model, messages=messages, options=SHORT)
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.done and whole.done_reason in ("stop", "length")
    assert 0 < whole.eval_count <= SHORT["num_predict"]
    assert whole.prompt_eval_count >= 1
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0

    parts = list(client.chat(model=model, messages=messages, options=SHORT, stream=True))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert all(p.message.role == "assistant" for p in parts)
    # same prompt, seed and temperature 0: the stream spells the same answer
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_generate_whole_and_streamed(client, model):
    whole = client.generate(model=model, prompt="The sky is", options=SHORT)
    assert whole.response and whole.done and 0 < whole.eval_count <= 8
    parts = list(client.generate(model=model, prompt="The sky is", options=SHORT, stream=True))
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")
    assert "".join(p.response for p in parts) == whole.response
    raw = client.generate(model=model, prompt="1, 2, 3,", raw=True, options=SHORT)
    assert raw.done and raw.eval_count > 0


def test_unknown_model_is_a_404(client):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404 and "not found" in info.value.error


def test_pull_succeeds_and_embed_explains_the_missing_flag(client, model):
    assert client.pull(model).status == "success"
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model=model, input="hello")
    assert info.value.status_code == 501 and "--embeddings" in info.value.error


def test_cached_prompt_survives_a_session_switch(stack, model):
    """A, B, A: A's second turn evaluates only its new tokens, not its long system prompt."""
    def session(chat_id: str, seed: int):
        client = ollama.Client(host=stack.url, timeout=180,
                               headers={"X-OpenWebUI-Chat-Id": chat_id})
        return client, [{"role": "system", "content": long_text(400, seed)},
                        {"role": "user", "content": "Summarise rule 1 in five words."}]

    a, a_messages = session("chat-ollama-a", 31)
    b, b_messages = session("chat-ollama-b", 32)
    first = a.chat(model=model, messages=a_messages, options=SHORT)
    b.chat(model=model, messages=b_messages, options=SHORT)
    a_messages += [{"role": "assistant", "content": first.message.content},
                   {"role": "user", "content": "And rule 2?"}]
    again = a.chat(model=model, messages=a_messages, options=SHORT)
    # The system prompt is prefilled for its base snapshot before the first answer, so the
    # first turn's own count is small too; the point is that A's return is not a prefill.
    system_tokens = count_tokens(stack, a_messages[0]["content"])
    assert system_tokens > 400 and first.prompt_eval_count > 0
    assert again.prompt_eval_count < 0.2 * system_tokens
