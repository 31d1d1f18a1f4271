"""A sliding-window model (Gemma 3 270M) behind kvproxy: restores are reused with --swa-full.

llama-server keeps only the window of an SWA model's sliding layers by default, so
a restored slot is recomputed past it ("forcing full prompt re-processing due to
lack of cache data"). kvproxy's process helpers start llama-server with
``--swa-full`` when the GGUF declares a sliding window; the deployment unit
always passes it. Two conversations interleave through each real client
library, so every returning turn is a restore from the slot file.
"""
from __future__ import annotations


import anthropic
import ollama
import openai
import pytest
import requests

from kvproxy.launch.processes import swa_model, wants_swa_full
from kvproxy.upstream import gguf
from tests.conftest import Stack, count_tokens, long_text

pytestmark = pytest.mark.real

WORDS = 900  # about 1,200 tokens: well past Gemma 3 270M's 512-token window


def test_the_test_model_declares_a_sliding_window_and_the_bundled_one_does_not():
    from kvproxy.launch.processes import bundled_model
    assert gguf.sliding_window(gguf.file_facts(swa_model())[0]) == 512
    assert wants_swa_full(swa_model()) and not wants_swa_full(bundled_model())


@pytest.fixture(scope="module")
def swa_stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("swa"), model=swa_model()).start()
    yield stack
    stack.stop()


def interleave(ask, seed: int) -> list[tuple[int, int]]:
    """Conversations A and B, one turn each, then A again: ``ask(system, messages)`` answers
    (reply text, reused tokens, prompt tokens); returns A's two (reused, prompt) pairs."""
    system_a, system_b = long_text(WORDS, seed), long_text(WORDS, seed + 1)
    first = [{"role": "user", "content": "Name the first rule in three words."}]
    reply_a, *turn_1 = ask(system_a, first)
    ask(system_b, first)                            # B takes the slot: A is saved
    again = first + [{"role": "assistant", "content": reply_a},
                     {"role": "user", "content": "And the second rule?"}]
    _, *turn_2 = ask(system_a, again)               # A comes back from its file
    return [tuple(turn_1), tuple(turn_2)]


def test_llama_server_was_started_with_swa_full_and_the_restore_probe_passed(swa_stack):
    assert "--swa-full" in swa_stack.llama.command()
    assert "restore probe passed" in swa_stack.proxy_log()
    check = requests.get(swa_stack.url + "/api/sessions/current", timeout=30).json()
    assert not check["restore_check"]["restoring_off"], check


def openai_asker(url: str):
    """``ask`` for ``interleave`` through the OpenAI client: (reply, reused, prompt tokens)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)

    def ask(system, messages):
        reply = client.chat.completions.create(
            model="m", max_tokens=8, temperature=0,
            messages=[{"role": "system", "content": system}, *messages])
        usage = reply.usage
        return (reply.choices[0].message.content or "", usage.prompt_tokens_details.cached_tokens,
                usage.prompt_tokens)
    return ask


def test_openai_a_returning_turn_reuses_its_restored_prompt(swa_stack):
    (_, _), (reused, prompt) = interleave(openai_asker(swa_stack.url), 31)
    print(f"\nopenai: returning turn reused {reused} of {prompt} prompt tokens")
    assert reused >= 0.95 * prompt


def test_anthropic_a_returning_turn_reuses_its_restored_prompt(swa_stack):
    client = anthropic.Anthropic(base_url=swa_stack.url, api_key="x", max_retries=0, timeout=300)

    def ask(system, messages):
        reply = client.messages.create(model="m", max_tokens=8, system=system,
                                       messages=messages)
        usage = reply.usage
        text = "".join(block.text for block in reply.content if block.type == "text")
        return text, usage.cache_read_input_tokens, \
            usage.input_tokens + usage.cache_read_input_tokens
    (_, _), (reused, prompt) = interleave(ask, 41)
    print(f"\nanthropic: returning turn reused {reused} of {prompt} prompt tokens")
    assert reused >= 0.95 * prompt


def test_ollama_a_returning_turn_computes_only_its_new_turn(swa_stack):
    client = ollama.Client(host=swa_stack.url, timeout=300)
    model = client.list().models[0].model

    def ask(system, messages):
        reply = client.chat(model=model, options={"num_predict": 8, "temperature": 0},
                            messages=[{"role": "system", "content": system}, *messages])
        return reply.message.content or "", 0, reply.prompt_eval_count
    (_, _), (_, computed) = interleave(ask, 51)
    system_tokens = count_tokens(swa_stack, long_text(WORDS, 51))
    print(f"\nollama: returning turn computed {computed} tokens behind a "
          f"{system_tokens}-token system prompt")
    # Ollama reports only what was computed: the restored prompt is not in it.
    assert computed <= 0.05 * system_tokens


def test_without_swa_full_restoring_is_off_from_the_start_and_back_on_after_the_fix(tmp_path):
    """Why the flag: the probe's restore on a default llama-server is recomputed, so before
    any conversation restoring is off with the fix named, and no file is written that
    would never be restored; a conversation coming back is computed afresh. Restarting
    llama-server with the flag turns restoring back on without restarting kvproxy."""
    stack = Stack(tmp_path, model=swa_model(), llama_args={"swa_full": False}).start()
    try:
        assert "--swa-full" not in stack.llama.command()
        check = requests.get(stack.url + "/api/sessions/current", timeout=30).json()
        assert check["restore_check"]["restoring_off"], check
        assert "start llama-server with --swa-full" in check["restore_check"]["cause"]
        failed = [line for line in stack.proxy_log().splitlines() if "restore probe failed" in line]
        assert len(failed) == 1 and "--swa-full" in failed[0]
        (_, _), (reused, prompt) = interleave(openai_asker(stack.url), 61)
        print(f"\nwithout --swa-full: returning turn reused {reused} of {prompt} prompt tokens; "
              f"probe: {failed[0].split('failed: ')[-1]}")
        assert reused < 0.5 * prompt
        assert not list(stack.slot_dir.glob("*.bin")), "no file that would never be restored"

        # The fix, with kvproxy left running: the next swap finds its slot emptied, probes
        # again, and restoring is back on for the conversations that follow.
        stack.llama.swa_full = True
        stack.llama.restart()
        (_, _), (reused, prompt) = interleave(openai_asker(stack.url), 71)
        print(f"after a restart with --swa-full: returning turn reused {reused} of {prompt}")
        assert reused >= 0.95 * prompt
        check = requests.get(stack.url + "/api/sessions/current", timeout=30).json()
        assert not check["restore_check"]["restoring_off"], check
    finally:
        stack.stop()
