"""Turn a benchmark run (the JSON dict) into targets, tables, a plot and its docs/benchmark.md section."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"   # raw figures, plots and generated sections
PAGE = ROOT / "docs" / "benchmark.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"

REUSE_TARGET = 0.95
SPEEDUP_TARGET = 20.0
TOKENS_TARGET = 1.1
OVERHEAD_TARGET_MS = 3.0
MEMORY_TARGET_KIB = 4096


def _turns(run: dict, mode: str) -> list[dict]:
    return (run.get("workload", {}).get(mode) or {}).get("turns") or []


def _reuse(turn: dict) -> float:
    total = turn["prompt_n"] + turn["cache_n"]
    return turn["cache_n"] / total if total else 0.0


def returning_turns(run: dict, mode: str) -> dict[str, dict]:
    """Each conversation's first turn after the restart, by conversation."""
    return {t["conversation"]: t for t in _turns(run, mode) if t["first_after_restart"]}


def targets(run: dict) -> list[dict]:
    """PASS/FAIL (or N/A when the figure was not measured) for each target of the brief."""
    out = []

    def add(ident: str, text: str, value: str, passed: bool | None) -> None:
        out.append({"id": ident, "target": text, "measured": value,
                    "status": "N/A" if passed is None else ("PASS" if passed else "FAIL")})

    b_ret, a_ret = returning_turns(run, "b"), returning_turns(run, "a")
    if b_ret:
        shares = {c: _reuse(t) for c, t in b_ret.items()}
        worst = min(shares, key=shares.get)
        add("T1", f"kvproxy, after the restart: returning conversations reuse >= {REUSE_TARGET:.0%} "
                  "of their prompt (every conversation)",
            ", ".join(f"{c} {s:.1%}" for c, s in sorted(shares.items())) + f" (lowest {worst})",
            all(s >= REUSE_TARGET for s in shares.values()))
    else:
        add("T1", f"kvproxy, after the restart: reuse >= {REUSE_TARGET:.0%}", "not measured", None)
    if a_ret and b_ret and all(t.get("ttft_s") for t in list(a_ret.values()) + list(b_ret.values())):
        common = sorted(set(a_ret) & set(b_ret))
        a_sum = sum(a_ret[c]["ttft_s"] for c in common)
        b_sum = sum(b_ret[c]["ttft_s"] for c in common)
        add("T2", f"kvproxy, after the restart: returning conversations start >= {SPEEDUP_TARGET:.0f}x "
                  "faster than (a) (sum of their times to first token)",
            f"{a_sum:.2f} s vs {b_sum:.2f} s = {a_sum / b_sum:.1f}x", a_sum / b_sum >= SPEEDUP_TARGET)
        ratios = {c: a_ret[c]["ttft_s"] / b_ret[c]["ttft_s"] for c in common}
        add("T2'", f"same, for every conversation on its own (>= {SPEEDUP_TARGET:.0f}x each)",
            ", ".join(f"{c} {r:.1f}x" for c, r in ratios.items()),
            all(r >= SPEEDUP_TARGET for r in ratios.values()))
    else:
        add("T2", f"kvproxy starts >= {SPEEDUP_TARGET:.0f}x faster than (a) after the restart",
            "not measured", None)
    wb = run.get("workload", {}).get("b")
    if wb and wb.get("minimum_tokens"):
        ratio = wb["computed_tokens"] / wb["minimum_tokens"]
        add("T3", f"kvproxy computes <= {TOKENS_TARGET}x the minimum prompt tokens over the workload",
            f"{wb['computed_tokens']} / {wb['minimum_tokens']} = {ratio:.3f}x", ratio <= TOKENS_TARGET)
    else:
        add("T3", f"kvproxy computes <= {TOKENS_TARGET}x the minimum", "not measured", None)
    ov = run.get("sections", {}).get("overhead")
    if ov:
        bare = (f"; a bare Flask relay under the same gunicorn adds "
                f"{ov['bare']['added_median_ms']:.2f} ms") if ov.get("bare") else ""
        add("T4", f"median proxy overhead without a swap < {OVERHEAD_TARGET_MS:.0f} ms",
            f"{ov['added_median_ms']:.2f} ms (p99 {ov['added_p99_ms']:+.2f} ms; median of paired "
            f"differences {_s(ov.get('paired_difference_median_ms'))} ms{bare})",
            ov["added_median_ms"] < OVERHEAD_TARGET_MS)
    else:
        add("T4", f"median proxy overhead < {OVERHEAD_TARGET_MS:.0f} ms", "not measured", None)
    st = run.get("sections", {}).get("streaming")
    if st:
        add("T5", "streamed chunks are relayed as they come, not batched",
            f"median gap {st['proxy_gap_median_ms']:.1f} ms through kvproxy vs "
            f"{st['direct_gap_median_ms']:.1f} ms direct; <1 ms gaps "
            f"{st['proxy_gaps_under_1ms_share']:.0%} vs {st['direct_gaps_under_1ms_share']:.0%}",
            st["relayed_as_they_come"])
    mem = run.get("sections", {}).get("memory")
    if mem:
        add("T6", f"worker RSS does not grow with streamed replies (< {MEMORY_TARGET_KIB // 1024} MiB "
                  f"over {mem['replies']} replies)",
            f"{mem['growth_kib'] / 1024:+.1f} MiB ({mem['rss_before_kib'] / 1024:.1f} -> "
            f"{mem['rss_after_kib'] / 1024:.1f} MiB, {mem['bytes_streamed'] / 1e6:.1f} MB streamed)",
            mem["growth_kib"] < MEMORY_TARGET_KIB)
    return out


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def turns_table(run: dict) -> str:
    modes = [m for m in ("a", "b", "c") if _turns(run, m)]
    header = ["#", "turn", "min new"]
    for m in modes:
        header += [f"{m} ttft s", f"{m} computed", f"{m} reused"]
        if m == "b":
            header.append("b cache")
    rows = []
    base = _turns(run, modes[0])
    for i, turn in enumerate(base):
        name = f"{turn['conversation']}{turn['round'] + 1}" + (" ↻" if turn["first_after_restart"] else "")
        row = [i + 1, name, _turns(run, "b")[i]["min_new_tokens"] if "b" in modes
               else turn["min_new_tokens"]]
        for m in modes:
            t = _turns(run, m)[i]
            row += [_s(t["ttft_s"]), t["prompt_n"], t["cache_n"]]
            if m == "b":
                row.append(t["cache_header"] or "-")
        rows.append(row)
    return _table(header, rows)


def totals_table(run: dict) -> str:
    modes = [m for m in ("a", "b", "c") if _turns(run, m)]
    labels = {m: run["modes"][m]["label"] for m in modes}
    rows = []

    def row(name: str, fn) -> None:
        rows.append([name] + [fn(m) for m in modes])

    w = lambda m: run["workload"][m]  # noqa: E731
    row("prompt tokens computed", lambda m: w(m)["computed_tokens"])
    row("prompt tokens reused", lambda m: w(m)["reused_tokens"])
    row("minimum possible (each distinct token once)", lambda m: w(m)["minimum_tokens"])
    row("computed / minimum", lambda m: f"{w(m)['computed_tokens'] / max(1, w(m)['minimum_tokens']):.2f}x")
    row("time in requests, s", lambda m: _s(w(m)["request_seconds"], 1))
    row("restart, s", lambda m: _s(w(m)["restart_seconds"], 1))
    row("wall time incl. restart, s", lambda m: _s(w(m)["wall_seconds"], 1))
    row("median time to first token, s",
        lambda m: _s(statistics.median([t["ttft_s"] for t in w(m)["turns"] if t["ttft_s"]])))
    row("time to first token, first turns after restart (sum), s",
        lambda m: _s(sum(t["ttft_s"] or 0 for t in returning_turns(run, m).values())))
    row("reuse share, first turns after restart",
        lambda m: ", ".join(f"{c} {_reuse(t):.0%}" for c, t in sorted(returning_turns(run, m).items())))
    if "a" in modes:
        a = w("a")["request_seconds"]
        row("time in requests: (a) / this mode", lambda m: f"{a / w(m)['request_seconds']:.2f}x")
    return _table(["", *[labels[m] for m in modes]], rows)


def io_table(run: dict) -> str:
    rows = []
    for r in run.get("sections", {}).get("slot_io") or []:
        rows.append([r["tokens"], f"{r['bytes'] / 1e6:.1f}",
                     f"{r['save_wall_ms_median']:.1f} ({r['save_mb_s']:.0f} MB/s)",
                     f"{r['restore_wall_ms_median']:.1f} ({r['restore_mb_s']:.0f} MB/s)",
                     f"{r['read_ms_median']:.1f} ({r['read_mb_s']:.0f} MB/s)",
                     f"{r['save_ms_median']:.1f} / {r['restore_ms_median']:.1f}"])
    return _table(["tokens", "file MB", "save ms (MB/s)", "restore ms (MB/s)",
                   "plain file read ms (MB/s)", "llama-server's own save/restore ms"], rows)


def overhead_table(run: dict) -> str:
    sections = run.get("sections", {})
    rows = []
    ov = sections.get("overhead")
    if ov:
        rows.append([f"kvproxy: tiny request, max_tokens 1, no swap (n={ov['n']} each)",
                     f"{ov['direct_median_ms']:.2f} / {ov['direct_p99_ms']:.2f}",
                     f"{ov['proxy_median_ms']:.2f} / {ov['proxy_p99_ms']:.2f}",
                     f"{ov['added_median_ms']:+.2f} / {ov['added_p99_ms']:+.2f}"])
        if ov.get("bare"):
            bare = ov["bare"]
            rows.append(["reference: bare Flask relay (bench/passthrough.py) under the same gunicorn, "
                         "same requests",
                         f"{bare['direct_median_ms']:.2f} / {bare['direct_p99_ms']:.2f}",
                         f"{bare['proxy_median_ms']:.2f} / {bare['proxy_p99_ms']:.2f}",
                         f"{bare['added_median_ms']:+.2f} / {bare['added_p99_ms']:+.2f}"])
    st = sections.get("streaming")
    if st:
        rows.append([f"kvproxy streaming: time to first chunk (n={st['n']} each)",
                     f"{st['first_chunk_direct_median_ms']:.2f} / {st['first_chunk_direct_p99_ms']:.2f}",
                     f"{st['first_chunk_proxy_median_ms']:.2f} / {st['first_chunk_proxy_p99_ms']:.2f}",
                     f"{st['first_chunk_added_median_ms']:+.2f} / {st['first_chunk_added_p99_ms']:+.2f}"])
        rows.append(["kvproxy streaming: gap between chunks, median",
                     f"{st['direct_gap_median_ms']:.2f}", f"{st['proxy_gap_median_ms']:.2f}",
                     f"{st['proxy_gap_median_ms'] - st['direct_gap_median_ms']:+.2f}"])
    if not rows:
        return ""
    return _table(["ms: median / p99", "llama-server direct", "through the proxy", "added"], rows)


def targets_table(run: dict) -> str:
    return _table(["", "target", "measured", "result"],
                  [[t["id"], t["target"], t["measured"], f"**{t['status']}**"]
                   for t in run["targets"]])


def machine_line(run: dict) -> str:
    m = run["machine"]
    return (f"{m['cores']} cores, {m['cpu']}, {m['ram_gib']} GiB RAM; model {run.get('model')}, "
            f"llama.cpp build {run.get('build_info')}, n_ctx {run.get('n_ctx')}; load average "
            f"{' '.join(map(str, run.get('loadavg_start') or []))} at start, "
            f"{' '.join(map(str, run.get('loadavg_end') or []))} at end")


def workload_line(run: dict) -> str:
    convs = run.get("conversations") or []
    s = run["settings"]
    return (f"{len(convs)} conversations ("
            + ", ".join(f"{c['name']}: system prompt {c['prompt']} {c['system_tokens']} tokens"
                        for c in convs)
            + f"), {s['turns']} turns each, round-robin, replies of {s['max_tokens']} tokens, "
            f"llama-server{' and kvproxy' if 'b' in run['workload'] else ''} restarted before round "
            f"{s['restart_after'] + 1}; streaming OpenAI chat requests without session ids.")


def memory_line(run: dict) -> str:
    mem = run.get("sections", {}).get("memory")
    if not mem:
        return ""
    return (f"gunicorn worker RSS (VmRSS): {mem['rss_before_kib'] / 1024:.1f} MiB before, "
            f"{mem['rss_after_kib'] / 1024:.1f} MiB after streaming {mem['replies']} replies of "
            f"{mem['max_tokens']} tokens ({mem['bytes_streamed'] / 1e6:.1f} MB relayed), "
            f"peak {mem['rss_peak_kib'] / 1024:.1f} MiB.")


NOTES = [
    "'minimum' counts, for each turn, the prompt tokens (chat template plus tokenizer, as "
    "llama-server does) that are not a prefix of an earlier prompt followed by its reply, and at "
    "least one; the same figure for every mode when the replies match.",
    "T2 sums the time to first token of each conversation's first turn after the restart; T2' "
    "takes each conversation alone. C shares its system prompt with A, and in (a) llama-server's "
    "--cache-ram resumes C from A's state after the restart, so (a) is already quick for C.",
    "The overhead reference line is a Flask app that only relays the request "
    "(bench/passthrough.py) under the same gunicorn settings: the floor for a Python proxy here. "
    "Client, proxy and llama-server share the same 2 cores.",
    "Timings are wall-clock from the client, and other jobs on the machine add noise: the load "
    "average is in the machine line.",
]


def text_report(run: dict) -> str:
    parts = [f"Machine: {machine_line(run)}", f"Workload: {workload_line(run)}",
             "", "Per turn (↻ = the conversation's first turn after the restart; 'min new' = "
             "tokens a perfect prefix cache would compute):", "", turns_table(run),
             "", "Totals:", "", totals_table(run)]
    if run.get("sections", {}).get("slot_io"):
        parts += ["", "Slot files (page cache warm; no fsync; dropping the page cache is not "
                  "possible here, so the file read is warm too):", "", io_table(run)]
    ov = overhead_table(run)
    if ov:
        parts += ["", "Proxy overhead:", "", ov]
    if memory_line(run):
        parts += ["", "Memory: " + memory_line(run)]
    parts += ["", "Targets:", "", targets_table(run), "", "Notes:"]
    parts += [f"- {note}" for note in NOTES]
    return "\n".join(parts)


def page_section(run: dict, png: str) -> str:
    """The main scenario's section of docs/benchmark.md; ``png`` is relative to that page."""
    return "\n".join([
        START,
        "## Main scenario",
        "",
        f"Generated by `{run['command']}` (`make bench`) on {run['started_at']}, "
        f"{run['duration_seconds']:.0f} s. Raw figures: `bench/results/"
        f"{Path(png).stem}.json`.",
        "",
        f"**Machine:** {machine_line(run)}. Other work on the machine makes timings noisy.",
        "",
        f"**Workload:** {workload_line(run)} Modes run one after the other, each with its own "
        "llama-server (same build and model) and a fresh slot folder.",
        "",
        totals_table(run),
        "",
        f"![benchmark plot]({png})",
        "",
        "### Targets",
        "",
        targets_table(run),
        "",
        *[f"- {note}" for note in NOTES],
        "",
        "### Slot save and restore",
        "",
        "Warm page cache (the file was just written; no fsync), so the plain read is a memory "
        "copy, not a disk read: the machine gives no way to drop the cache.",
        "",
        io_table(run),
        "",
        "### Proxy overhead",
        "",
        overhead_table(run),
        "",
        memory_line(run),
        "",
        "<details><summary>Every turn</summary>",
        "",
        turns_table(run),
        "",
        "</details>",
        END,
    ])


def update_page(path: Path, section: str, start_marker: str = START,
                  end_marker: str = END) -> bool:
    """Replace the text between the markers (markers included); False when they are missing."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    start, end = text.find(start_marker), text.find(end_marker)
    if start < 0 or end < start:
        return False
    new = text[:start] + section + text[end + len(end_marker):]
    tmp = path.with_name(path.name + ".bench.tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)
    return True


def plot(run: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"a": "tab:orange", "b": "tab:blue", "c": "tab:gray"}
    modes = [m for m in ("a", "b", "c") if _turns(run, m)]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    ax = axes[0][0]
    for m in modes:
        ts = _turns(run, m)
        ax.plot([t["index"] + 1 for t in ts], [t["ttft_s"] or float("nan") for t in ts], "o-",
                color=colors[m], label=run["modes"][m]["label"], ms=4)
    restart = [t["index"] + 0.5 for t in _turns(run, modes[0]) if t["first_after_restart"]][:1]
    base = _turns(run, modes[0])
    for ax_ in (axes[0][0], axes[0][1]):
        for x in restart:
            ax_.axvline(x, color="red", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_xticks([t["index"] + 1 for t in base])
    ax.set_xticklabels([f"{t['conversation']}{t['round'] + 1}" for t in base], fontsize=7)
    ax.set_title("Time to first token per turn (red: restart)")
    ax.set_ylabel("seconds (log)")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    for m in modes:
        ts = _turns(run, m)
        cum, total = [], 0
        for t in ts:
            total += t["prompt_n"]
            cum.append(total)
        ax.plot([t["index"] + 1 for t in ts], cum, "o-", color=colors[m], ms=4,
                label=run["modes"][m]["label"])
    ref = _turns(run, "b" if "b" in modes else modes[0])
    cum, total = [], 0
    for t in ref:
        total += t["min_new_tokens"] or 0
        cum.append(total)
    ax.plot([t["index"] + 1 for t in ref], cum, "k:", label="minimum (each distinct token once)")
    ax.set_xticks([t["index"] + 1 for t in base])
    ax.set_xticklabels([f"{t['conversation']}{t['round'] + 1}" for t in base], fontsize=7)
    ax.set_title("Prompt tokens computed, cumulative")
    ax.legend(fontsize=8)

    ax = axes[0][2]
    io = run.get("sections", {}).get("slot_io") or []
    if io:
        mb = [r["bytes"] / 1e6 for r in io]
        ax.plot(mb, [r["save_wall_ms_median"] for r in io], "o-", label="save (POST, wall)")
        ax.plot(mb, [r["restore_wall_ms_median"] for r in io], "s-", label="restore (POST, wall)")
        ax.plot(mb, [r["read_ms_median"] for r in io], "^--", label="plain file read (warm cache)")
        for r, x in zip(io, mb):
            ax.annotate(f"{r['restore_mb_s']:.0f} MB/s", (x, r["restore_wall_ms_median"]),
                        fontsize=7, textcoords="offset points", xytext=(4, -10))
        ax.set_xlabel("slot file MB")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    ax.set_title("Slot save / restore vs file size")

    ax = axes[1][0]
    ov = run.get("sections", {}).get("overhead")
    if ov:
        for key, label, color in (("direct_ms", "llama-server direct", "tab:orange"),
                                  ("bare_ms", "bare Flask relay (reference)", "tab:green"),
                                  ("proxy_ms", "through kvproxy", "tab:blue")):
            if not ov.get(key):
                continue
            values = sorted(ov[key])
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], color=color,
                    label=f"{label} (median {statistics.median(values):.1f} ms)")
        ax.set_xlabel("ms, tiny request (max_tokens 1), no swap")
        ax.set_ylabel("share of requests")
        ax.legend(fontsize=8)
    ax.set_title("Proxy overhead (CDF)")

    ax = axes[1][1]
    st = run.get("sections", {}).get("streaming")
    if st:
        labels = ["first chunk\nmedian", "first chunk\np99", "inter-chunk gap\nmedian"]
        direct = [st["first_chunk_direct_median_ms"], st["first_chunk_direct_p99_ms"],
                  st["direct_gap_median_ms"]]
        proxy = [st["first_chunk_proxy_median_ms"], st["first_chunk_proxy_p99_ms"],
                 st["proxy_gap_median_ms"]]
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], direct, 0.4, label="direct", color="tab:orange")
        ax.bar([x + 0.2 for x in xs], proxy, 0.4, label="through kvproxy", color="tab:blue")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    ax.set_title("Streaming relay")

    ax = axes[1][2]
    mem = run.get("sections", {}).get("memory")
    if mem:
        ax.plot([s[0] for s in mem["samples"]], [s[1] / 1024 for s in mem["samples"]], "o-", ms=3)
        ax.set_xlabel(f"replies streamed ({mem['max_tokens']} tokens each)")
        ax.set_ylabel("MiB")
        low = min(s[1] for s in mem["samples"]) / 1024
        ax.set_ylim(low - 5, low + 15)
    ax.set_title("kvproxy worker RSS")

    fig.suptitle(f"kvproxy benchmark — {run['machine']['cores']} cores, {run['machine']['cpu']}, "
                 f"{run.get('model')} — {run['started_at']}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".png.tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def write_figures(out: Path, run: dict, section: str) -> None:
    """A standalone benchmark's figures: ``<out>.json`` (raw) and ``<out>.md`` (its section)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(run, indent=1) + "\n")
    out.with_suffix(".md").write_text(section + "\n")


def put_on_page(section: str, start_marker: str, end_marker: str) -> None:
    """The section into docs/benchmark.md between its markers, or one line saying why not."""
    if not update_page(PAGE, section, start_marker, end_marker):
        print(f"{PAGE.name} has no {start_marker} ... {end_marker} section: left as it is")
