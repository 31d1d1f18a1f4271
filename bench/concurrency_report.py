"""Tables, plot and docs/benchmark.md section of the concurrency scenario (the dict run.py stores)."""
from __future__ import annotations

from pathlib import Path

from . import batched
from .concurrency_stats import crosstalk_text
from .report import _s, _table, machine_line, targets_table

START, END = "<!-- bench-concurrency:start -->", "<!-- bench-concurrency:end -->"
COLORS = {"a": "tab:orange", "b": "tab:blue", "c": "tab:green"}


def _modes(group: dict) -> list[str]:
    return [m for m in ("a", "b", "c") if m in group.get("summaries", {})]


def group_table(group: dict) -> str:
    modes = _modes(group)
    rows = []

    def row(name: str, fn) -> None:
        rows.append([name] + [fn(group["summaries"][m]) for m in modes])

    row("time to first token p50, turns after the first, s", lambda s: _s(s["ttft_later_p50_s"]))
    row("time to first token p95, turns after the first, s", lambda s: _s(s["ttft_later_p95_s"]))
    row("time to first token, slowest first turn, s", lambda s: _s(s.get("ttft_first_max_s"), 1))
    row("wall time, s", lambda s: _s(s["wall_seconds"], 1))
    row("of which a turn in flight, s", lambda s: _s(s.get("in_flight_seconds"), 1))
    if all(s.get("cpu") for s in group["summaries"].values()):
        row("CPU seconds: llama-server, kvproxy", lambda s: " / ".join(
            _s(s["cpu"].get(k), 1) for k in ("llama_server", "kvproxy") if k in s["cpu"]))
        row("machine busy, core-seconds (share of all cores)", lambda s: "-" if
            s["cpu"].get("machine_busy_share") is None else
            f"{s['cpu']['machine_busy']:.1f} ({s['cpu']['machine_busy_share']:.0%})")
    row("generated tokens per second", lambda s: _s(s["generated_per_s"], 1))
    row("prompt tokens computed", lambda s: s["computed_tokens"])
    row("minimum (each conversation's new tokens once)", lambda s: s["minimum_tokens"])
    row("computed / minimum", lambda s: "-" if s["computed_over_minimum"] is None
        else f"{s['computed_over_minimum']:.2f}x")
    row("ran in another conversation's cache", crosstalk_text)
    if any(group["modes"][m]["proxied"] for m in modes):
        row("kvproxy cache header (turns)", lambda s: ", ".join(
            f"{k} {n}" for k, n in sorted(s["cache_headers"].items())) if "-" not in
            s["cache_headers"] else "-")
    table = _table(["", *[group["modes"][m]["label"] for m in modes]], rows)
    failed = [f"{key}: {error}" for key, error in (group.get("failed") or {}).items()]
    return table + ("\n\nFailed modes: " + "; ".join(failed) if failed else "")


def overhead_table(conc: dict) -> str:
    ov = conc.get("overhead") or {}
    rows = []
    for key in ("b", "c"):
        o = ov.get(key)
        if o:
            rows.append([conc["mode_labels"][key], f"{o['direct_median_ms']:.2f}",
                         f"{o['proxy_median_ms']:.2f}", f"{o['added_median_ms']:+.2f}",
                         f"{o['added_p99_ms']:+.2f}", f"{o['paired_difference_median_ms']:+.2f}"])
    path = conc.get("slot_path")
    if path:
        rows.append([f"kvproxy driving 1 slot, then {path['slots']}, on llama-servers of the same "
                     f"layout (-np {path['slots']}), alternated, n={path['requests_each']} each: "
                     "request time, not added", "-", f"{path['one_slot_median_ms']:.2f} / "
                     f"{path['all_slots_median_ms']:.2f}", "-", "-", "-"])
    recorded = conc.get("overhead_recorded")
    if recorded:
        rows.append([f"recorded in bench/results/latest.json ({recorded['started_at']})",
                     f"{recorded['direct_median_ms']:.2f}", f"{recorded['proxy_median_ms']:.2f}",
                     f"{recorded['added_median_ms']:+.2f}", f"{recorded['added_p99_ms']:+.2f}", "-"])
    if not rows:
        return ""
    return _table(["tiny request, no swap, ms", "direct median", "through kvproxy median",
                   "added median", "added p99", "paired difference median"], rows)


def settings_line(conc: dict) -> str:
    s = conc["settings"]
    return (f"{', then '.join(str(u) for u in s['users'])} users at once, each with its own system "
            f"prompt of {s['system_tokens'][0]} to {s['system_tokens'][1]} tokens, {s['turns']} "
            f"streamed turns each (OpenAI chat, no session id, replies of at most "
            f"{s['max_tokens']} tokens, temperature 0), {s['think'][0]} to {s['think'][1]} s of "
            f"thinking between turns; every slot has {s['slot_ctx']} tokens of context "
            f"(`-c` = slots x {s['slot_ctx']}). Each mode and group runs on a fresh llama-server "
            f"(same build and model).")


def scaled_line(conc: dict) -> str:
    """The scaled-RAM scenario's arithmetic, or '' when the run was not one."""
    sc = conc.get("scaled_cache_ram")
    if not sc:
        return ""
    return (f"Scaled RAM cache: {sc['gib']:g} GiB hold {sc['tokens']:,} tokens of a 70B-class "
            f"model ({sc['reference_bytes_per_token']:,} KV bytes per token); this model's KV "
            f"takes {sc['model_bytes_per_token']:,} bytes per token (from its GGUF header), so "
            f"every llama-server gets at most `--cache-ram {sc['mib']}` (MiB).")


def modes_lines(conc: dict) -> list[str]:
    out = [scaled_line(conc)] if scaled_line(conc) else []
    for key, text in (conc.get("mode_commands") or {}).items():
        out.append(f"- {conc['mode_labels'][key]}: `{text}`")
    return out


NOTES = [
    "Times to first token are for each user's turns after its first (the first turns all "
    "prefill a long system prompt at the same moment); wall time runs from the start to the "
    "last byte of the last turn, think times included; generated tokens per second is every "
    "token generated divided by that wall time.",
    "'minimum' counts, per turn, the prompt tokens (chat template plus tokenizer, as "
    "llama-server does) beyond the longest prefix it shares with a prompt computed before its "
    "first token came or a reply finished by then (any conversation's), and at least one. "
    "kvproxy's system-prompt snapshots are counted as computed too.",
    "'ran in another conversation's cache': a turn reused more tokens than its prompt shares "
    "with anything computed in the run (reuse), computed plus reused differs from its "
    "prompt's length (length), or kvproxy's X-KVProxy-Session header changed within a "
    "conversation or was shared by two (session). The counts cannot see a slot whose cache "
    "differs from what llama-server believes it holds.",
]


def text_report(conc: dict) -> str:
    parts = [f"Machine: {machine_line(conc)}", f"Workload: {settings_line(conc)}", "",
             *modes_lines(conc)]
    for group in conc["groups"]:
        parts += ["", f"{group['users']} users:", "", group_table(group)]
    parts += ["", "Parallel generation on this machine (llama-batched-bench):", "",
              batched.table(conc.get("batched") or {})]
    ov = overhead_table(conc)
    if ov:
        parts += ["", "Proxy overhead without a swap:", "", ov]
    parts += ["", "Targets:", "", targets_table(conc), "", "Notes:"]
    parts += [f"- {note}" for note in NOTES]
    return "\n".join(parts)


def page_section(conc: dict, png: str) -> str:
    """The concurrency section of docs/benchmark.md; ``png`` is relative to that page."""
    lines = [START, "## Several users at once", "",
             f"Generated by `{conc['command']}` on {conc['started_at']}, "
             f"{conc['duration_seconds']:.0f} s. Raw figures: `bench/results/{Path(png).stem}.json`.",
             "", f"**Machine:** {machine_line(conc)}.", "",
             f"**Workload:** {settings_line(conc)}", "", *modes_lines(conc)]
    for group in conc["groups"]:
        lines += ["", f"**{group['users']} users**", "", group_table(group)]
    lines += ["", f"![concurrency plot]({png})", "",
              "**What the hardware gives**: generation for several sequences at once "
              f"(`{(conc.get('batched') or {}).get('command', 'llama-batched-bench')}`):", "",
              batched.table(conc.get("batched") or {}), ""]
    ov = overhead_table(conc)
    if ov:
        lines += ["**Proxy overhead without a swap** (same requests as the main benchmark):", "",
                  ov, ""]
    lines += ["**Targets**", "", targets_table(conc), "", *[f"- {n}" for n in NOTES], END]
    return "\n".join(lines)


def plot(conc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = conc["groups"]
    fig, axes = plt.subplots(max(1, len(groups)), 3, figsize=(16, 4.2 * max(1, len(groups))),
                             squeeze=False)
    for row, group in zip(axes, groups):
        modes = _modes(group)
        label = lambda m: group["modes"][m]["label"]  # noqa: E731
        ax = row[0]
        for m in modes:
            turns = group["results"][m]["turns"]
            ax.plot([t["sent_s"] for t in turns if t["round"] >= 1 and t["ttft_s"] is not None],
                    [t["ttft_s"] for t in turns if t["round"] >= 1 and t["ttft_s"] is not None],
                    "o", color=COLORS[m], ms=4, label=label(m))
        ax.set_yscale("log")
        ax.set_xlabel("s since the start (when the turn was sent)")
        ax.set_ylabel("time to first token, s (log)")
        ax.set_title(f"{group['users']} users: turns after the first")
        ax.legend(fontsize=8)

        ax = row[1]
        xs = list(range(len(modes)))
        summaries = [group["summaries"][m] for m in modes]
        colors = [COLORS[m] for m in modes]
        ax.bar([x - 0.2 for x in xs], [s["ttft_later_p50_s"] or 0 for s in summaries], 0.4,
               color=colors, alpha=0.45, label="p50 time to first token")
        ax.bar([x + 0.2 for x in xs], [s["ttft_later_p95_s"] or 0 for s in summaries], 0.4,
               color=colors, label="p95 time to first token")
        ax2 = ax.twinx()
        ax2.plot(xs, [s["wall_seconds"] for s in summaries], "kD", ms=8, label="wall time")
        ax2.set_ylim(0, max(s["wall_seconds"] for s in summaries) * 1.25)
        ax.set_xticks(xs)
        ax.set_xticklabels([label(m) for m in modes], fontsize=8)
        ax.set_ylabel("s, time to first token (light p50, dark p95)")
        ax2.set_ylabel("s, wall time (black diamonds)")
        ax.set_title(f"{group['users']} users: latency and wall time")

        ax = row[2]
        ax.bar([x - 0.2 for x in xs], [s["computed_tokens"] for s in summaries], 0.4, color=colors)
        ax.bar([x + 0.2 for x in xs], [s["minimum_tokens"] for s in summaries], 0.4,
               color="lightgray", label="minimum")
        top = max(max(s["computed_tokens"], s["minimum_tokens"]) for s in summaries)
        for x, s in zip(xs, summaries):
            ratio = s["computed_over_minimum"]
            ax.annotate(("CROSS-TALK" if s["crosstalk_turns"] else "no cross-talk")
                        + (f"\n{ratio:.2f}x the minimum" if ratio else "")
                        + f"\n{s['generated_per_s'] or 0:.1f} generated tok/s",
                        (x, max(s["computed_tokens"], s["minimum_tokens"])), ha="center",
                        fontsize=7, textcoords="offset points", xytext=(0, 3))
        ax.set_ylim(0, top * 1.3)
        ax.set_xticks(xs)
        ax.set_xticklabels([label(m) for m in modes], fontsize=8)
        ax.set_ylabel("prompt tokens: computed (colour), minimum (grey)", fontsize=8)
        ax.set_title(f"{group['users']} users: prompt tokens")
    rows = (conc.get("batched") or {}).get("rows") or []
    batch_text = ", ".join(f"{r['pl']}: {r['speed_tg']:.0f}" for r in rows)
    fig.suptitle(f"kvproxy concurrency benchmark — {conc['machine']['cores']} cores, "
                 f"{conc.get('model')} — {conc['started_at']}"
                 + (f" — llama-batched-bench generation tok/s by parallel sequences {batch_text}"
                    if batch_text else ""), fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".png.tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    tmp.replace(path)
