"""The multi-conversation workload and the token accounting around it.

Four (by default) conversations with long system prompts, two of them
sharing one prompt, take turns round-robin. Halfway through, llama-server
(and the proxy, when there is one) restarts. The same script runs against
every mode; each mode keeps its own histories (the replies are its own).
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

import requests

from .client import stream_chat, templated_tokens, tokenize

WORDS = ["river", "lantern", "copper", "meadow", "signal", "harbor", "quiet", "orbit",
         "granite", "velvet", "thunder", "maple", "circuit", "falcon", "ember", "tide",
         "archive", "compass", "prism", "willow", "beacon", "glacier", "saddle", "cipher"]


def long_text(n_words: int, seed: int) -> str:
    """Deterministic prose (same generator as tests/conftest.py), different for each seed."""
    rng = random.Random(seed)
    sentences: list[str] = []
    count = 0
    while count < n_words:
        length = rng.randint(8, 16)
        sentence = " ".join(rng.choice(WORDS) for _ in range(length))
        sentences.append(f"Rule {len(sentences) + 1}: {sentence.capitalize()}.")
        count += length + 2
    return f"Project {seed} handbook. " + " ".join(sentences)


def text_of_tokens(http: requests.Session, llama_url: str, target: int, seed: int) -> tuple[str, int]:
    """A system prompt of about ``target`` tokens (within 2 %), measured by llama-server."""
    words = max(20, int(target / 1.3))
    text, n = "", 0
    for _ in range(6):
        text = long_text(words, seed)
        n = len(tokenize(http, llama_url, text, special=False))
        if abs(n - target) <= max(8, target * 0.02):
            break
        words = max(20, int(words * target / max(n, 1)))
    return text, n


@dataclass
class Conversation:
    name: str
    system: str
    system_tokens: int
    prompt_group: str
    questions: list[str]


def build_conversations(http: requests.Session, llama_url: str, prompt_tokens: list[int],
                        turns: int, seed: int = 1000) -> list[Conversation]:
    """Conversations A, B, C, D...: A and C share prompt 1; the others have their own.

    ``prompt_tokens`` lists the distinct system prompt sizes; with three sizes
    there are four conversations (A: p1, B: p2, C: p1, D: p3), interleaved so
    the two that share a prompt are not neighbours.
    """
    texts = [text_of_tokens(http, llama_url, n, seed + i) for i, n in enumerate(prompt_tokens)]
    plan = [0, 1, 0] + list(range(2, len(prompt_tokens))) if len(prompt_tokens) >= 2 else [0, 0]
    conversations = []
    for index, group in enumerate(plan):
        name = chr(ord("A") + index)
        rng = random.Random(seed * 7 + index)
        questions = [f"Question {t + 1} from reader {name}: in one short sentence, what does rule "
                     f"{rng.randint(1, 40)} say about the {rng.choice(WORDS)}?" for t in range(turns)]
        text, n = texts[group]
        conversations.append(Conversation(name, text, n, f"p{group + 1}", questions))
    return conversations


@dataclass
class Turn:
    mode: str
    index: int          # order in the run, from 0
    round: int          # the conversation's turn number, from 0
    conversation: str
    after_restart: bool
    first_after_restart: bool
    ttft_s: float | None
    first_byte_s: float | None
    total_s: float
    prompt_n: int
    cache_n: int
    prompt_ms: float
    predicted_n: int
    cache_header: str | None
    session_header: str | None
    status: int
    error: str | None
    reply_chars: int
    prompt_tokens_checked: int | None = None   # len(template + tokenize) of the same messages
    min_new_tokens: int | None = None          # what a perfect prefix cache would compute


@dataclass
class WorkloadResult:
    mode: str
    turns: list[Turn] = field(default_factory=list)
    request_seconds: float = 0.0   # sum of request times (restarts excluded)
    restart_seconds: float = 0.0
    wall_seconds: float = 0.0      # first request to last byte, restarts included
    minimum_tokens: int = 0
    computed_tokens: int = 0
    reused_tokens: int = 0
    token_check_mismatches: int = 0
    metrics_after: dict = field(default_factory=dict)
    sidecars: list[dict] = field(default_factory=list)


def run_workload(mode, conversations: list[Conversation], turns: int, restart_after: int,
                 max_tokens: int, read_timeout: float, log) -> tuple[WorkloadResult, list[list[dict]]]:
    """Run every conversation round-robin for ``turns`` turns, restarting before turn ``restart_after``.

    Returns the result and, per turn, the exact messages sent (for token accounting).
    """
    result = WorkloadResult(mode.key)
    histories = {c.name: [{"role": "system", "content": c.system}] for c in conversations}
    sent: list[list[dict]] = []
    replies: list[str] = []
    first_after: set[str] = set()
    wall_started = time.monotonic()
    index = 0
    with requests.Session() as http:
        for round_no in range(turns):
            if restart_after and round_no == restart_after:
                log(f"  [{mode.key}] restarting {'llama-server and kvproxy' if mode.proxy else 'llama-server'}")
                http.close()
                result.restart_seconds += mode.restart()
            for conv in conversations:
                messages = histories[conv.name] + [{"role": "user", "content": conv.questions[round_no]}]
                body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 42}
                answer = stream_chat(http, mode.url, body, read_timeout=read_timeout)
                after = bool(restart_after) and round_no >= restart_after
                first = after and conv.name not in first_after
                if first:
                    first_after.add(conv.name)
                t = answer.timings
                turn = Turn(mode=mode.key, index=index, round=round_no, conversation=conv.name,
                            after_restart=after, first_after_restart=first,
                            ttft_s=answer.first_token, first_byte_s=answer.first_byte,
                            total_s=answer.total, prompt_n=int(t.get("prompt_n") or 0),
                            cache_n=int(t.get("cache_n") or 0),
                            prompt_ms=float(t.get("prompt_ms") or 0.0),
                            predicted_n=int(t.get("predicted_n") or 0),
                            cache_header=answer.headers.get("X-KVProxy-Cache"),
                            session_header=answer.headers.get("X-KVProxy-Session"),
                            status=answer.status, error=answer.error,
                            reply_chars=len(answer.content))
                result.turns.append(turn)
                result.request_seconds += answer.total
                log(f"  [{mode.key}] turn {index + 1:2d} {conv.name}{round_no + 1}"
                    f"{' (after restart)' if after else ''}: ttft "
                    f"{_fmt_s(answer.first_token)} computed {turn.prompt_n} reused {turn.cache_n}"
                    + (f" cache={turn.cache_header}" if turn.cache_header else "")
                    + (f" ERROR {answer.status} {answer.error}" if answer.error or answer.status != 200 else ""))
                sent.append(messages)
                replies.append(answer.content)
                histories[conv.name] = messages + [{"role": "assistant", "content": answer.content}]
                index += 1
    result.wall_seconds = time.monotonic() - wall_started
    result.computed_tokens = sum(t.prompt_n for t in result.turns)
    result.reused_tokens = sum(t.cache_n for t in result.turns)
    return result, [sent, replies]


def account_tokens(result: WorkloadResult, llama_url: str, sent: list[list[dict]],
                   replies: list[str]) -> None:
    """Fill in the minimum: tokens a perfect prefix cache, never losing anything, would compute.

    Every prompt is tokenized exactly as llama-server would (chat template, then
    tokenizer). A turn's minimum is its prompt minus the longest prefix it shares
    with anything computed before it (an earlier prompt plus the reply generated
    after it), and at least one token (llama-server always evaluates one).
    """
    seen: list[list[int]] = []
    minimum = mismatches = 0
    with requests.Session() as http:
        for turn, messages, reply in zip(result.turns, sent, replies):
            tokens = templated_tokens(http, llama_url, messages)
            turn.prompt_tokens_checked = len(tokens)
            if turn.prompt_n + turn.cache_n and len(tokens) != turn.prompt_n + turn.cache_n:
                mismatches += 1
            shared = max((len(os.path.commonprefix([tokens, s])) for s in seen), default=0)
            turn.min_new_tokens = max(1, len(tokens) - shared)
            minimum += turn.min_new_tokens
            seen.append(tokens + tokenize(http, llama_url, reply, special=False))
    result.minimum_tokens = minimum
    result.token_check_mismatches = mismatches


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"
