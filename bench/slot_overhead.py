"""No-swap overhead of one slot against several, on the same llama-server: ``python -m
bench.slot_overhead`` (``make bench-slot-overhead``).

The concurrency scenario measures (b) and (c) on different llama-servers (``-np 1`` and
``-np N``), minutes apart, so their added latencies also differ by llama-server's layout and
by the machine's drift. Here two llama-servers with the same layout (``-np N``) each get a
kvproxy, one driving a single slot (as before several slots existed), one driving all N, and
the same tiny request goes to each in turn: the difference is kvproxy's own request path.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

import requests

from kvproxy.launch.processes import LlamaServer

from .client import timed_json
from .micro import percentile
from .procs import Proxy

BODY = {"messages": [{"role": "user", "content": "Reply with the word yes."}],
        "max_tokens": 1, "temperature": 0}


def measure(slots: int, slot_ctx: int, requests_each: int, work: Path) -> dict[int, list[float]]:
    """Milliseconds per request through kvproxy driving 1 and ``slots`` slots, alternated."""
    stacks: dict[int, tuple[LlamaServer, Proxy]] = {}
    try:
        for driven in (1, slots):
            folder = work / f"driving-{driven}"
            folder.mkdir()
            llama = LlamaServer(str(folder), slots=slots, ctx_size=slots * slot_ctx,
                                cache_ram_mib=0, log_path=str(work / f"llama-{driven}.log"))
            stacks[driven] = (llama.start(), None)
            proxy = Proxy(llama.url, str(folder), str(work / f"kvproxy-{driven}.log"),
                          env={"KVPROXY_SLOTS": str(driven), "KVPROXY_LOG_LEVEL": "WARNING"})
            stacks[driven] = (llama, proxy.start())
        times: dict[int, list[float]] = {driven: [] for driven in stacks}
        rng = random.Random(11)
        with requests.Session() as http:
            for driven, (_, proxy) in stacks.items():
                for _ in range(5):   # the first one swaps the slot to this session
                    timed_json(http, proxy.url, BODY)
            for _ in range(requests_each):
                order = list(stacks.items())
                rng.shuffle(order)
                for driven, (_, proxy) in order:
                    seconds, response = timed_json(http, proxy.url, BODY)
                    response.raise_for_status()
                    if response.headers.get("X-KVProxy-Cache") != "hit":
                        raise RuntimeError(f"kvproxy driving {driven} slot(s) swapped: "
                                           "the figure would not be a no-swap request")
                    times[driven].append(seconds * 1000)
        return times
    finally:
        for llama, proxy in stacks.values():
            if proxy is not None:
                proxy.stop()
            llama.stop()


def summary(times: dict[int, list[float]], slots: int) -> dict:
    """Medians and p90s of ``measure``'s figures, as the concurrency report shows them."""
    def p90(values: list[float]) -> float:
        return round(percentile(values, 90), 3)
    return {"slots": slots, "requests_each": len(times[1]),
            "one_slot_median_ms": round(statistics.median(times[1]), 3),
            "all_slots_median_ms": round(statistics.median(times[slots]), 3),
            "one_slot_p90_ms": p90(times[1]), "all_slots_p90_ms": p90(times[slots])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--slot-ctx", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=400, help="requests to each kvproxy")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvproxy-slot-overhead-") as work:
        print(f"two llama-servers -np {args.slots}, kvproxy driving 1 and {args.slots} slots, "
              f"{args.requests} alternated no-swap requests each ...", flush=True)
        times = measure(args.slots, args.slot_ctx, args.requests, Path(work))
    figures = summary(times, args.slots)
    one, many = figures["one_slot_median_ms"], figures["all_slots_median_ms"]
    print(f"  kvproxy driving 1 slot: median {one:.2f} ms, p90 {figures['one_slot_p90_ms']:.2f} ms")
    print(f"  kvproxy driving {args.slots} slots: median {many:.2f} ms, "
          f"p90 {figures['all_slots_p90_ms']:.2f} ms")
    print(f"  {args.slots} slots / 1 slot: {many / one:.3f}x the median request time "
          f"({many - one:+.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
