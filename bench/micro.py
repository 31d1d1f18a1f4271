"""Separate figures: slot save/restore speed, proxy overhead, streaming relay, proxy memory."""
from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import requests

from .client import CONNECT_TIMEOUT, slot_action, stream_chat, timed_json, tokenize
from .procs import rss_kib
from .workload import long_text

MIB = 1024 * 1024


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in 0..100."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def read_file_seconds(path: Path, block: int = 8 * MIB) -> float:
    """Time to read a whole file into memory (page cache warm: llama-server just wrote it)."""
    buffer = bytearray(block)
    view = memoryview(buffer)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(view):
            pass
    return time.perf_counter() - started


def slot_io(llama_url: str, slot_dir: Path, sizes: list[int], repeats: int, log) -> list[dict]:
    """Save and restore the slot at several sizes; a plain file read of each file for reference.

    The slot is filled with a growing token prefix, so each size only prefills
    the difference to the previous one.
    """
    rows = []
    with requests.Session() as http:
        words = int(max(sizes) / 1.2) + 200
        tokens = tokenize(http, llama_url, long_text(words, 4242), special=False)
        while len(tokens) < max(sizes):
            words *= 2
            tokens = tokenize(http, llama_url, long_text(words, 4242), special=False)
        slot_action(http, llama_url, "erase")
        for n in sorted(sizes):
            response = http.post(llama_url + "/completion",
                                 json={"prompt": tokens[:n], "n_predict": 1, "cache_prompt": True,
                                       "temperature": 0},
                                 timeout=(CONNECT_TIMEOUT, 600))
            response.raise_for_status()
            name = f"bench-io-{n}.bin"
            saves = []
            for _ in range(repeats):
                wall, answer = slot_action(http, llama_url, "save", name)
                saves.append((wall, float((answer.get("timings") or {}).get("save_ms", wall * 1000)),
                              int(answer.get("n_written") or 0), int(answer.get("n_saved") or 0)))
            rows.append({"tokens": n, "file": name, "n_saved": saves[0][3],
                         "bytes": (slot_dir / name).stat().st_size,
                         "save_wall_ms": [round(s[0] * 1000, 2) for s in saves],
                         "save_ms": [round(s[1], 2) for s in saves]})
        for row in rows:
            restores, reads = [], []
            for _ in range(repeats):
                slot_action(http, llama_url, "erase")
                wall, answer = slot_action(http, llama_url, "restore", row["file"])
                restores.append((wall, float((answer.get("timings") or {}).get("restore_ms", wall * 1000))))
                reads.append(read_file_seconds(slot_dir / row["file"]))
            row["restore_wall_ms"] = [round(r[0] * 1000, 2) for r in restores]
            row["restore_ms"] = [round(r[1], 2) for r in restores]
            row["read_ms"] = [round(r * 1000, 2) for r in reads]
            mb = row["bytes"] / 1e6
            for key in ("save_wall_ms", "save_ms", "restore_wall_ms", "restore_ms", "read_ms"):
                row[key + "_median"] = round(statistics.median(row[key]), 2)
            row["save_mb_s"] = round(mb / (row["save_wall_ms_median"] / 1000), 1)
            row["restore_mb_s"] = round(mb / (row["restore_wall_ms_median"] / 1000), 1)
            row["read_mb_s"] = round(mb / (row["read_ms_median"] / 1000), 1)
            log(f"  slot io {row['tokens']:5d} tokens {mb:7.1f} MB: save {row['save_wall_ms_median']:.0f} ms, "
                f"restore {row['restore_wall_ms_median']:.0f} ms, file read {row['read_ms_median']:.0f} ms")
        slot_action(http, llama_url, "erase")
    for row in rows:
        try:
            (slot_dir / row["file"]).unlink()
        except FileNotFoundError:
            pass
    return rows


def overhead(proxy_url: str, llama_url: str, n: int, log, bare_url: str | None = None) -> dict:
    """Added latency of a request that needs no swap: tiny non-streamed requests, alternated.

    With ``bare_url`` (bench.passthrough under gunicorn) a third leg measures what a
    proxy that does nothing but relay costs, as the floor for kvproxy's figure.
    """
    body = {"messages": [{"role": "user", "content": "Reply with the word yes."}],
            "max_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {"direct": [], "proxy": [], "bare": []}
    not_hit = 0
    rng = random.Random(7)
    with requests.Session() as to_proxy, requests.Session() as to_llama, \
            requests.Session() as to_bare:
        legs = [("direct", to_llama, llama_url), ("proxy", to_proxy, proxy_url)]
        if bare_url:
            legs.append(("bare", to_bare, bare_url))
        for _ in range(5):   # the first one swaps the slot to this session
            for _kind, http, url in legs:
                timed_json(http, url, body)
        for _ in range(n):
            order = list(legs)
            rng.shuffle(order)
            for kind, http, url in order:
                seconds, response = timed_json(http, url, body)
                response.raise_for_status()
                times[kind].append(seconds)
                if kind == "proxy":
                    not_hit += response.headers.get("X-KVProxy-Cache") != "hit"
    direct, proxied = times["direct"], times["proxy"]
    out = summarize_pair(direct, proxied)
    out.update(n=n, requests_not_hit=not_hit,
               direct_ms=[round(s * 1000, 3) for s in direct],
               proxy_ms=[round(s * 1000, 3) for s in proxied])
    if times["bare"]:
        out["bare"] = summarize_pair(direct, times["bare"])
        out["bare_ms"] = [round(s * 1000, 3) for s in times["bare"]]
        log(f"  bare Flask relay (reference): median {out['bare']['proxy_median_ms']:.2f} ms, "
            f"added median {out['bare']['added_median_ms']:.2f} ms")
    log(f"  overhead: direct median {out['direct_median_ms']:.2f} ms, proxy median "
        f"{out['proxy_median_ms']:.2f} ms, added median {out['added_median_ms']:.2f} ms, "
        f"added p99 {out['added_p99_ms']:.2f} ms")
    return out


def summarize_pair(direct: list[float], proxied: list[float]) -> dict:
    d50, p50 = statistics.median(direct) * 1000, statistics.median(proxied) * 1000
    d99, p99 = percentile(direct, 99) * 1000, percentile(proxied, 99) * 1000
    paired = [(p - d) * 1000 for d, p in zip(direct, proxied)]  # run back to back, order shuffled
    return {"direct_median_ms": round(d50, 3), "proxy_median_ms": round(p50, 3),
            "direct_p99_ms": round(d99, 3), "proxy_p99_ms": round(p99, 3),
            "added_median_ms": round(p50 - d50, 3), "added_p99_ms": round(p99 - d99, 3),
            "paired_difference_median_ms": round(statistics.median(paired), 3)}


def streaming(proxy_url: str, llama_url: str, n: int, max_tokens: int, log,
              budget_s: float = 600) -> dict:
    """Time to first chunk through the proxy vs direct, and whether chunks are relayed one by one.

    Stops after ``budget_s`` seconds (a busy machine), with the pairs done so far.
    """
    body = {"messages": [{"role": "user", "content": "Count slowly from one to one hundred."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    first = {"direct": [], "proxy": []}
    gaps = {"direct": [], "proxy": []}
    reads = {"direct": 0, "proxy": 0}
    events = {"direct": 0, "proxy": 0}
    rng = random.Random(11)
    deadline = time.monotonic() + budget_s
    done = 0
    with requests.Session() as to_proxy, requests.Session() as to_llama:
        stream_chat(to_proxy, proxy_url, body, read_timeout=120)
        stream_chat(to_llama, llama_url, body, read_timeout=120)
        for _ in range(n):
            if done and time.monotonic() > deadline:
                log(f"  streaming: time budget of {budget_s:.0f} s used up after {done} pairs")
                break
            done += 1
            order = [("direct", to_llama, llama_url), ("proxy", to_proxy, proxy_url)]
            rng.shuffle(order)
            for kind, http, url in order:
                result = stream_chat(http, url, body, read_timeout=120)
                if result.status != 200 or result.first_event is None:
                    raise RuntimeError(f"{kind} stream failed: {result.status} {result.error}")
                first[kind].append(result.first_event)
                times = result.event_times
                gaps[kind].extend(b - a for a, b in zip(times[1:], times[2:]))  # after the 1st token
                events[kind] += max(0, len(times) - 1)
                reads[kind] += len({t for t in times[1:]})
    out = summarize_pair(first["direct"], first["proxy"])
    out = {"first_chunk_" + k: v for k, v in out.items()}
    for kind in ("direct", "proxy"):
        g = gaps[kind]
        out[f"{kind}_gap_median_ms"] = round(statistics.median(g) * 1000, 3) if g else None
        out[f"{kind}_gaps_under_1ms_share"] = round(sum(x < 0.001 for x in g) / len(g), 4) if g else None
        out[f"{kind}_events"] = events[kind]
        out[f"{kind}_distinct_arrivals"] = reads[kind]
    d, p = out["direct_gap_median_ms"] or 0, out["proxy_gap_median_ms"] or 0
    out["relayed_as_they_come"] = bool(
        d and p and 0.5 * d <= p <= 2 * d
        and out["proxy_gaps_under_1ms_share"] <= out["direct_gaps_under_1ms_share"] + 0.1)
    out.update(n=done, n_planned=n, max_tokens=max_tokens)
    log(f"  streaming: added time to first chunk median {out['first_chunk_added_median_ms']:.2f} ms; "
        f"inter-chunk gap median direct {d:.2f} ms, proxy {p:.2f} ms; chunks arriving <1 ms after "
        f"the previous: direct {out['direct_gaps_under_1ms_share']:.0%}, proxy "
        f"{out['proxy_gaps_under_1ms_share']:.0%}")
    return out


def memory(proxy, n: int, max_tokens: int, log, budget_s: float = 900) -> dict:
    """RSS of the gunicorn worker before and after streaming ``n`` long replies through it.

    Stops after ``budget_s`` seconds (a busy machine), with the replies streamed so far.
    """
    pid = proxy.worker_pid()
    if pid is None:
        raise RuntimeError("could not find the gunicorn worker process")
    body = {"messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    samples = []
    streamed = 0
    with requests.Session() as http:
        for _ in range(3):  # warm-up: imports, connection pools, first swap
            streamed += stream_chat(http, proxy.url, body, read_timeout=300).n_bytes
        before = rss_kib(pid)
        samples.append((0, before))
        streamed = 0
        deadline = time.monotonic() + budget_s
        for i in range(1, n + 1):
            if i > 1 and time.monotonic() > deadline:
                log(f"  memory: time budget of {budget_s:.0f} s used up after {i - 1} replies")
                break
            result = stream_chat(http, proxy.url, body, read_timeout=300)
            if result.status != 200:
                raise RuntimeError(f"stream failed: {result.status} {result.error}")
            streamed += result.n_bytes
            samples.append((i, rss_kib(pid)))
    after = samples[-1][1]
    peak = max(s[1] for s in samples)
    out = {"worker_pid": pid, "replies": samples[-1][0], "replies_planned": n,
           "max_tokens": max_tokens,
           "bytes_streamed": streamed, "rss_before_kib": before, "rss_after_kib": after,
           "rss_peak_kib": peak, "growth_kib": after - before, "samples": samples}
    log(f"  memory: worker RSS {before / 1024:.1f} MiB before, {after / 1024:.1f} MiB after "
        f"{n} replies ({streamed / 1e6:.1f} MB streamed), peak {peak / 1024:.1f} MiB")
    return out
