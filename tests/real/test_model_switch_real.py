"""One slot folder, llama-server restarted with another model and back: nothing is lost.

Every file carries its model's tag, so conversation A held under SmolLM2, then under
Gemma 3, then under SmolLM2 again keeps one file per model; the base snapshot of the
shared system prompt too. Back on SmolLM2, A's next turn is restored from SmolLM2's file.
"""
from __future__ import annotations

import openai
import pytest

from kvproxy.launch.processes import bundled_model, swa_model
from kvproxy.sessions.identity import model_tag
from tests.conftest import Stack, long_text
from tests.support import saved_stems

pytestmark = pytest.mark.real


def ask(url: str, session: str, messages: list[dict]) -> tuple[str, int, int, str]:
    """One turn: (reply, reused tokens, prompt tokens, X-KVProxy-Cache)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model="m", max_tokens=8, temperature=0, messages=messages,
        extra_headers={"X-Session-Id": session})
    reply = raw.parse()
    usage = reply.usage
    return (reply.choices[0].message.content or "", usage.prompt_tokens_details.cached_tokens,
            usage.prompt_tokens, raw.headers["X-KVProxy-Cache"])


@pytest.mark.timeout(600)
def test_a_conversation_keeps_its_file_per_model_across_model_switches(tmp_path):
    system = {"role": "system", "content": long_text(300, 7)}
    first = [system, {"role": "user", "content": "Name the first rule in three words."}]
    stack = Stack(tmp_path).start()
    try:
        reply, *_ = ask(stack.url, "A", first)
        ask(stack.url, "B", first)                     # A saved under SmolLM2
        smollm = model_tag(bundled_model())
        stack.stop_proxy()
        stack.llama.model, stack.llama.swa_full = swa_model(), True   # the same folder
        stack.llama.restart()
        stack.start_proxy()
        _, reused, _, cache = ask(stack.url, "A", first)
        assert cache != "restored", "SmolLM2's file is never offered to Gemma 3"
        ask(stack.url, "B", first)                     # A saved again, under Gemma 3
        gemma = model_tag(swa_model())
        names = saved_stems(stack.slot_dir)
        for model in (smollm, gemma):                  # A and the base, once per model
            assert any(n.startswith("client_A_") and n.endswith(f"@{model}")
                       for n in names), names
            assert any(n.startswith("base.") and n.endswith(f"@{model}") for n in names)
        stack.stop_proxy()
        stack.llama.model, stack.llama.swa_full = bundled_model(), False   # and back
        stack.llama.restart()
        stack.start_proxy()
        again = first + [{"role": "assistant", "content": reply},
                         {"role": "user", "content": "And the second rule?"}]
        _, reused, prompt, cache = ask(stack.url, "A", again)
        print(f"\nback on SmolLM2: {cache}, {reused} of {prompt} prompt tokens reused")
        assert cache == "restored" and reused >= 0.9 * prompt, (cache, reused, prompt)
    finally:
        stack.stop()
