"""Does a smaller llama-server batch finish mixed work sooner? ``python -m bench.batch_mix``.

The work a slot queue leaves llama-server while new conversations wait: one slot prefills a
long prompt while the three others each answer three short turns. A smaller ``-b`` puts
more of the short turns' generated tokens into the prefill's batches. This times the same
work mixed and with the prefill first (its answers after it, as when they queue behind it),
on a fresh llama-server per batch size and round (4 slots, no RAM cache, the bundled model):
does the order or the batch size save compute, or only move it? Prints each round and the
medians.
"""
from __future__ import annotations

import argparse
import random
import signal
import statistics
import tempfile
import threading
import time

import requests

from kvproxy.launch.processes import LlamaServer

from .workload import WORDS

READ_TIMEOUT_S = 600


def words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def mixed_work(url: str, rng: random.Random, long_words: int, turns: int, reply: int,
               apart: bool = False) -> float:
    """Seconds until a ``long_words`` prompt on slot 0 and ``turns`` answers of ``reply``
    tokens on each of slots 1-3, all started at once, are done; ``apart``: the prefill
    first, alone, then the answers (llama-server's order when the answers queue behind it)."""
    prompts = [words(long_words, rng)] + [words(60, rng) for _ in range(3 * turns)]
    failures: list[str] = []

    def post(prompt: str, slot: int, n_predict: int) -> None:
        try:
            requests.post(url + "/completion", timeout=(10, READ_TIMEOUT_S), json={
                "prompt": prompt, "n_predict": n_predict, "ignore_eos": True,
                "id_slot": slot, "cache_prompt": True}).raise_for_status()
        except requests.RequestException as exc:
            failures.append(repr(exc)[:200])

    def short_turns(slot: int) -> None:
        for turn in range(turns):
            post(prompts[1 + (slot - 1) * turns + turn], slot, reply)

    threads = [threading.Thread(target=short_turns, args=(slot,)) for slot in (1, 2, 3)]
    started = time.perf_counter()
    if apart:
        post(prompts[0], 0, 1)
    else:
        threads.append(threading.Thread(target=post, args=(prompts[0], 0, 1)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(READ_TIMEOUT_S * (turns + 1))
    if failures or any(t.is_alive() for t in threads):
        raise RuntimeError(f"mixed work failed: {failures or 'timed out'}")
    return time.perf_counter() - started


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    # SIGTERM (timeout, systemd, a CI runner) stops it as Ctrl-C does: the finally below
    # stops the llama-server it started.
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="2048,512,256,128", help="-b values to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long-words", type=int, default=2300, help="about 3,000 tokens")
    args = parser.parse_args(argv)
    sizes = [int(b) for b in args.batches.split(",")]
    rng = random.Random(7)
    seconds: dict[str, list[float]] = {}
    for round_no in range(args.rounds):
        for size in sizes:   # interleaved, so a slow moment of the machine hits every size
            with tempfile.TemporaryDirectory() as slot_dir:
                server = LlamaServer(slot_dir, slots=4, ctx_size=16384, cache_ram_mib=0,
                                     extra_args=["-b", str(size), "-ub", str(min(size, 512))])
                server.start(timeout=120)
                try:
                    mixed_work(server.url, rng, 200, 1, 4)   # warm-up
                    for apart in (False, True):
                        key = f"-b {size}, " + ("prefill first" if apart else "mixed")
                        seconds.setdefault(key, []).append(
                            mixed_work(server.url, rng, args.long_words, 3, 48, apart))
                        print(f"round {round_no + 1}, {key}: {seconds[key][-1]:.2f} s",
                              flush=True)
                finally:
                    server.stop()
    for key, values in seconds.items():
        print(f"{key}: median {statistics.median(values):.2f} s over "
              f"{', '.join(f'{v:.2f}' for v in values)}")


if __name__ == "__main__":
    main()
