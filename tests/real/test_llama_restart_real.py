"""llama-server restarted alone under a running kvproxy: fewer slots, another model and back,
another KV cache type and back (as a model swapper, a crash-restart or an operator does).

What kvproxy learned of llama-server (its slot count, fingerprint, KV format, slot sizes) must
be learned again from the new process: no answer may claim a cache it did not use (the
X-KVProxy-Cache header agrees with the usage's cached tokens), and back on the first
llama-server its conversations restore from their own files and new ones start from its base.
"""
from __future__ import annotations

import openai
import pytest
import requests

from kvproxy.launch.processes import bundled_model, swa_model
from tests.conftest import Stack, long_text

pytestmark = pytest.mark.real

QUANTIZED = ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]
FAST_SAVES = {"KVPROXY_SAVE_BEHIND_DELAY": "0.5"}


class Chat:
    """One conversation through kvproxy with the openai client; ``answers`` keeps
    (X-KVProxy-Cache, cached tokens, prompt tokens) of each turn."""

    def __init__(self, url: str, session: str, system: str):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                    timeout=300)
        self.session = session
        self.messages = [{"role": "system", "content": system}]
        self.answers: list[tuple[str, int, int]] = []

    def turn(self, question: str) -> tuple[str, int, int]:
        self.messages.append({"role": "user", "content": question})
        raw = self.client.chat.completions.with_raw_response.create(
            model="m", max_tokens=8, temperature=0, messages=self.messages,
            extra_headers={"X-Session-Id": self.session})
        reply = raw.parse()
        self.messages.append({"role": "assistant",
                              "content": reply.choices[0].message.content or ""})
        usage = reply.usage
        answer = (raw.headers["X-KVProxy-Cache"], usage.prompt_tokens_details.cached_tokens,
                  usage.prompt_tokens)
        self.answers.append(answer)
        return answer


def agrees(answer: tuple[str, int, int]) -> bool:
    """The header says what the usage shows: a hit or a restore reused most of the prompt,
    a base some of it, a miss none."""
    cache, cached, prompt = answer
    if cache in ("hit", "restored"):
        return cached >= 0.5 * prompt
    if cache == "base":
        return 0 < cached < prompt
    return cached == 0


def failed_restores(stack: Stack) -> float:
    for line in requests.get(stack.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('kvproxy_restore_misses_total{reason="failed"}'):
            return float(line.split()[-1])
    return 0.0


def restart_llama(stack: Stack, **changes) -> None:
    """llama-server alone restarted (same port and slot folder) with ``changes``; kvproxy
    keeps running."""
    stack.llama.stop()
    for name, value in changes.items():
        setattr(stack.llama, name, value)
    stack.llama.start()


@pytest.mark.timeout(900)
def test_fewer_slots_after_a_restart_no_two_sessions_share_one(tmp_path):
    # -np 4 -c 8192, then -np 2 -c 4096: 2,048 tokens a slot either way, but llama-server
    # refuses a file of another stream count ("n_stream mismatch"): -np 4 files start fresh.
    stack = Stack(tmp_path, slots=4, llama_args={"ctx_size": 8192}, **FAST_SAVES).start()
    try:
        chats = [Chat(stack.url, name, long_text(300, seed=40 + i))
                 for i, name in enumerate("ABCD")]
        for chat in chats:
            chat.turn("Name the first rule in three words.")
        restart_llama(stack, slots=2, ctx_size=4096)
        fresh = [chat.turn("And the second rule?") for chat in chats]
        again = [chat.turn("And the third rule?") for chat in chats]
        print("\nafter the restart with -np 2:", fresh, again)
        assert all(agrees(answer) for answer in fresh + again), (fresh, again)
        assert [answer[0] for answer in fresh] == ["miss"] * 4, "no -np 4 file is offered"
        assert [answer[0] for answer in again] == ["restored"] * 4, \
            "each conversation restores its own file, saved with -np 2"
        assert failed_restores(stack) == 0
    finally:
        stack.stop()


@pytest.mark.timeout(900)
def test_another_model_and_back_restores_each_conversation_and_base(tmp_path):
    stack = Stack(tmp_path, **FAST_SAVES).start()
    system = long_text(300, seed=7)
    try:
        a = Chat(stack.url, "A", system)
        a.turn("Name the first rule in three words.")
        a.turn("And the second rule?")
        Chat(stack.url, "B", system).turn("Name rule 5.")          # A saved, B from the base
        restart_llama(stack, model=swa_model(), swa_full=True)
        on_gemma = [a.turn("And the third rule?"),
                    Chat(stack.url, "C", system).turn("Name rule 9.")]
        print("\non Gemma 3:", on_gemma)
        assert all(agrees(answer) for answer in on_gemma), on_gemma
        assert on_gemma[0][0] == "miss", "no SmolLM2 file or base is used by Gemma 3"
        restart_llama(stack, model=bundled_model(), swa_full=False)
        d = Chat(stack.url, "D", system).turn("Name rule 12.")
        back = a.turn("And the fourth rule?")
        print(f"back on SmolLM2: new conversation {d}, A {back}")
        assert agrees(d) and agrees(back), (d, back)
        assert d[0] == "base", "a new conversation starts from SmolLM2's base snapshot"
        assert back[0] == "restored" and back[1] > d[1], "A restores its own SmolLM2 file"
        assert failed_restores(stack) == 0, "no file was offered to a server that cannot take it"
    finally:
        stack.stop()


@pytest.mark.timeout(900)
def test_another_kv_type_and_back_offers_no_file_of_the_other_type(tmp_path):
    stack = Stack(tmp_path, **FAST_SAVES).start()
    system = long_text(400, seed=11)
    try:
        a, b = Chat(stack.url, "A", system), Chat(stack.url, "B", system)
        before = [a.turn("Name one rule."), b.turn("Name rule 3."), a.turn("And rule 4?")]
        assert [answer[0] for answer in before] == ["miss", "base", "restored"], before
        restart_llama(stack, extra_args=QUANTIZED)
        quantized = [Chat(stack.url, "C", system).turn("Name rule 6."),
                     b.turn("And rule 7?"), Chat(stack.url, "E", system).turn("Name rule 2.")]
        print("\nwith q8_0 caches:", quantized)
        assert all(agrees(answer) for answer in quantized), quantized
        assert quantized[0][0] == "miss" and quantized[2][0] == "base", \
            "the base is made again for the q8_0 cache, then used"
        assert failed_restores(stack) == 0, "no f16 file was offered to the q8_0 server"
        restart_llama(stack, extra_args=[])
        back = a.turn("And rule 8?")
        print(f"back on f16: A {back}")
        assert agrees(back) and back[0] == "restored", "A restores its own f16 file"
        assert failed_restores(stack) == 0, "no q8_0 file was offered to the f16 server"
    finally:
        stack.stop()
