"""What it costs to report the prompt figures in Anthropic's message_start.

    .venv/bin/python -m bench.usage_start [--runs 10]

Against a bare llama-server with the bundled model:
  (1) ``timings_per_token``: the first token's chunk carries prompt_n and cache_n
      (what kvproxy does): bytes per chunk and the whole stream's time, with and without,
      for the recorded Claude Code turn cut as in its replay test (the prompt is cached
      after the first run, as in a conversation);
  (2) counting before streaming with /apply-template + /tokenize, for the full recorded
      prompt: the extra round trips, which also cannot tell cached from computed tokens.
Prints medians; nothing is written.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from claude_code_turns import turns  # noqa: E402
from kvproxy.translate import anthropic as anthropic_translate  # noqa: E402
from kvproxy.launch.processes import LlamaServer  # noqa: E402

RECORDED = ROOT / "tests" / "fixtures" / "recorded" / "claude-code" / "02-resumed-turn.json"


def stream(url: str, body: dict, per_token: bool) -> tuple[float, int, int]:
    """Seconds for the whole stream, its bytes and its chunk count."""
    started = time.perf_counter()
    with requests.post(url + "/v1/chat/completions", timeout=600, stream=True,
                       json={**body, "stream": True, "timings_per_token": per_token}) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith(b"data: {")]
    return time.perf_counter() - started, sum(map(len, lines)), len(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer")
    args = parser.parse_args()
    records = [json.loads(p.read_text()) for p in sorted(RECORDED.parent.glob("*.json"))]
    short = turns(records, shrink=400)[1]["body"]
    body = anthropic_translate.to_llama({**short, "max_tokens": args.tokens, "temperature": 0})
    body.update(id_slot=0, cache_prompt=True)
    full = anthropic_translate.to_llama(records[1]["body"], count_only=True)
    with tempfile.TemporaryDirectory() as tmp, LlamaServer(tmp) as llama:
        stream(llama.url, body, False)  # prefill once; every run then reuses the prompt
        figures = {flag: [stream(llama.url, body, flag) for _ in range(args.runs)]
                   for flag in (False, True)}
        counts = []
        for _ in range(args.runs):
            started = time.perf_counter()
            prompt = requests.post(llama.url + "/apply-template", json=full, timeout=60).json()
            tokens = requests.post(llama.url + "/tokenize", json={"content": prompt["prompt"]},
                                   timeout=60).json()["tokens"]
            counts.append(time.perf_counter() - started)
    for flag, runs in figures.items():
        seconds, size, chunks = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"timings_per_token={str(flag).lower():5}: stream {seconds * 1000:7.1f} ms, "
              f"{chunks:.0f} chunks, {size / chunks:6.0f} bytes a chunk")
    print(f"/apply-template + /tokenize of the {len(tokens)}-token prompt before streaming: "
          f"{statistics.median(counts) * 1000:.1f} ms (median of {args.runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
