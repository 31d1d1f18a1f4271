"""Where kvproxy's time went in a run, from its log: ``python -m bench.proxy_log <proxy.log>...``.

Counts the swaps by outcome (``cache=``) and placement (``placed=``) with their ``swap_ms``,
and the background saves (``saved session ... in the background (N tokens, M ms)``), so a
concurrency run kept with ``--keep`` shows how much of its time went to slot actions.
"""
from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

SWAP = re.compile(r"swap to session=\S+ source=\S+ cache=(?P<cache>\S+) slot=(?P<view>\S+) "
                  r"restored_tokens=\d+ swap_ms=(?P<ms>[\d.]+) id_slot=(?P<slot>\d+) "
                  r"placed=(?P<placed>\S+)")
BEHIND = re.compile(r"saved session \S+ from slot (?P<slot>\d+) in the background "
                    r"\((?P<tokens>\d+) tokens, (?P<ms>\d+) ms\)")


def summarize(text: str) -> dict:
    """Swaps by cache and placement, background saves: count, total and median ms."""
    swaps: dict[str, list[float]] = defaultdict(list)
    for m in SWAP.finditer(text):
        swaps[f"{m['cache']}/{m['placed']}"].append(float(m["ms"]))
    behind = [float(m["ms"]) for m in BEHIND.finditer(text)]
    out = {key: _stats(values) for key, values in sorted(swaps.items())}
    out["saved behind"] = _stats(behind)
    return out


def _stats(values: list[float]) -> dict:
    return {"count": len(values), "total_s": round(sum(values) / 1000, 2),
            "median_ms": round(statistics.median(values), 1) if values else None}


def table(summary: dict) -> str:
    lines = ["| swap (cache/placed) | count | total s | median ms |", "| --- | --- | --- | --- |"]
    for key, s in summary.items():
        lines.append(f"| {key} | {s['count']} | {s['total_s']} | "
                     f"{'-' if s['median_ms'] is None else s['median_ms']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    for path in argv:
        print(f"{path}:\n{table(summarize(Path(path).read_text(errors='replace')))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
