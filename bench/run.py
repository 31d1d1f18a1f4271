"""kvproxy benchmark: ``python -m bench.run`` (``make bench``), ``--quick`` for a smoke run.

Runs the same multi-conversation workload, with a restart halfway, against
  (a) llama-server with --cache-ram, clients straight to it,
  (b) kvproxy (gunicorn) in front of llama-server with --cache-ram,
  (c) llama-server without --cache-ram (optional),
each with its own llama-server and a fresh slot folder, one after the other.
Then, on the (b) stack: proxy overhead without a swap, streaming relay, worker
memory; on a bare llama-server: slot save/restore speed by file size.
Writes bench/results/<name>.json and .png and the docs/benchmark.md section between
``<!-- bench:start -->`` and ``<!-- bench:end -->``.

Then the swap cost (bench/swap_cost.py; ``--scenario swap`` alone, ``make bench-swap``):
one slot, two long conversations taking turns, kvproxy with save behind on and off; the
section between ``<!-- bench-swap:start -->`` and ``<!-- bench-swap:end -->``.

Then the concurrency scenario (bench/concurrency.py; ``--scenario concurrency`` runs it
alone, ``make bench-concurrency``): several users at once against llama-server ``-np N``
straight, kvproxy with one slot and kvproxy with N slots, plus llama-batched-bench.
It writes bench/results/concurrency.json and .png and the docs/benchmark.md section between
``<!-- bench-concurrency:start -->`` and ``<!-- bench-concurrency:end -->``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import requests

from . import concurrency, concurrency_report, micro, report, swap_cost
from .concurrency_stats import targets as concurrency_targets
from .procs import Mode, Proxy
from .readings import loadavg, machine, scrape_metrics, sidecars
from .report import PAGE, RESULTS, ROOT
from .workload import account_tokens, build_conversations, run_workload


def page_link(path: Path) -> str:
    """A results file as docs/benchmark.md links it."""
    return Path(os.path.relpath(path, PAGE.parent)).as_posix()


FULL = dict(prompt_tokens="2000,4000,6000", turns=4, restart_after=2, max_tokens=32,
            io_sizes="512,1024,2048,4096,6144", io_repeats=3, overhead_requests=100,
            stream_requests=20, stream_max_tokens=64, memory_replies=50, memory_max_tokens=256,
            modes="a,b,c")
QUICK = dict(prompt_tokens="400,600,900", turns=2, restart_after=1, max_tokens=8,
             io_sizes="256,512,1024", io_repeats=2, overhead_requests=20, stream_requests=4,
             stream_max_tokens=32, memory_replies=5, memory_max_tokens=64, modes="a,b")

# The concurrency scenario: users per group, llama-server slots for (a) and (c), context
# per slot, system prompt sizes, turns, reply length, think time range, llama-batched-bench.
CONC_FULL = dict(users="4,8", slots=4, slot_ctx=4096, system_tokens="1500,3000", conc_turns=5,
                 conc_max_tokens=48, think="0.5,2.0", conc_modes="a,b,c", batched="512,64,1,2,4")
CONC_QUICK = dict(users="2,4", slots=2, slot_ctx=1024, system_tokens="200,400", conc_turns=3,
                  conc_max_tokens=8, think="0.1,0.3", conc_modes="a,b,c", batched="128,16,1,2")

MODES = {
    "a": ("(a) llama-server --cache-ram", 16384, False),
    "b": ("(b) kvproxy", 16384, True),
    "c": ("(c) llama-server, no cache-ram", None, False),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a minute or two")
    p.add_argument("--scenario", choices=("all", "main", "swap", "concurrency"), default="all",
                   help="main: the restart workload and micro figures; swap: what a swap costs "
                   "with save behind on and off; concurrency: several users at once (default: "
                   "all three)")
    w = p.add_argument_group("swap scenario")
    w.add_argument("--swap-tokens", type=int, help="system prompt of each of the two "
                   "conversations, tokens (default 6000; quick 1000)")
    w.add_argument("--swap-turns", type=int, help="turns per conversation (default 6; quick 3)")
    w.add_argument("--swap-delay", type=float, default=0.5,
                   help="KVPROXY_SAVE_BEHIND_DELAY in the scenario (default 0.5 s)")
    c = p.add_argument_group("concurrency scenario")
    c.add_argument("--users", help="users at once, one group each (default 4,8; quick 2,4)")
    c.add_argument("--slots", type=int, help="llama-server slots of (a) and (c) (default 4; quick 2)")
    c.add_argument("--slot-ctx", type=int, help="context per slot in tokens; -c is slots times "
                   "this (default 4096)")
    c.add_argument("--system-tokens", help="smallest,largest system prompt (default 1500,3000)")
    c.add_argument("--conc-turns", type=int, help="turns per user (default 5)")
    c.add_argument("--conc-max-tokens", type=int, help="reply length limit (default 48)")
    c.add_argument("--think", help="min,max seconds between a user's turns (default 0.5,2.0)")
    c.add_argument("--conc-modes", help="comma list of a (llama-server -np N), b (kvproxy, one "
                   "slot), c (kvproxy, N slots); default a,b,c")
    c.add_argument("--batched", help="llama-batched-bench prompt,generated,parallel... "
                   "(default 512,64,1,2,4)")
    c.add_argument("--proxy-cache-ram", type=int, help="llama-server --cache-ram (MiB) behind "
                   "kvproxy in (b) and (c); default: what make run picks (off with several slots)")
    c.add_argument("--cache-ram-like-70b", dest="cache_ram_like_gib", type=float,
                   help="scaled-RAM scenario: every mode's llama-server --cache-ram holds as many "
                   "tokens of the bundled model as this many GiB hold for a 70B-class model "
                   "(327,680 KV bytes per token), e.g. 16")
    c.add_argument("--conc-budget", type=float, default=1800,
                   help="seconds one mode may take with one group before its users stop")
    p.add_argument("--modes", help="comma list of a, b, c (default: a,b,c; quick: a,b)")
    p.add_argument("--prompt-tokens", help="distinct system prompt sizes in tokens; the first is "
                   "shared by conversations A and C (default 2000,4000,6000)")
    p.add_argument("--turns", type=int, help="turns per conversation (default 4)")
    p.add_argument("--restart-after", type=int, help="restart before this round (default 2; 0: never)")
    p.add_argument("--max-tokens", type=int, help="reply length of workload turns (default 32)")
    p.add_argument("--io-sizes", help="slot sizes in tokens for save/restore timing")
    p.add_argument("--io-repeats", type=int)
    p.add_argument("--overhead-requests", type=int, help="tiny requests each way (default 100)")
    p.add_argument("--stream-requests", type=int, help="streams each way for the relay check")
    p.add_argument("--stream-max-tokens", type=int)
    p.add_argument("--memory-replies", type=int, help="long replies streamed for the RSS check")
    p.add_argument("--memory-max-tokens", type=int)
    p.add_argument("--section-budget", type=float, default=600,
                   help="seconds the streaming and memory sections may take each; they stop early "
                   "(and say so) on a machine too busy to finish them (default 600)")
    p.add_argument("--skip", default="", help="comma list of sections to skip: io, overhead, "
                   "streaming, memory, batched (llama-batched-bench)")
    p.add_argument("--read-timeout", type=float, default=600,
                   help="seconds a request may stay silent (prefill included)")
    p.add_argument("--name", help="results file name (default: latest, quick: quick)")
    p.add_argument("--page", dest="page", action="store_true", default=None,
                   help="rewrite the section of docs/benchmark.md (default for full runs)")
    p.add_argument("--no-page", dest="page", action="store_false")
    p.add_argument("--from-json", help="only re-render the report, plot and page section from "
                   "a results JSON file (no processes are started)")
    p.add_argument("--strict", action="store_true", help="exit with status 3 when a target fails")
    p.add_argument("--keep", action="store_true", help="keep the temporary slot folders and logs")
    args = p.parse_args(argv)
    args.name_given = args.name
    defaults = {**(QUICK if args.quick else FULL), **(CONC_QUICK if args.quick else CONC_FULL)}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.page is None:
        args.page = not args.quick
    args.name = args.name or ("quick" if args.quick else "latest")
    args.prompt_sizes = [int(x) for x in str(args.prompt_tokens).split(",") if x.strip()]
    args.io_size_list = [int(x) for x in str(args.io_sizes).split(",") if x.strip()]
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.skip_set = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = set(args.mode_list) - set(MODES)
    if unknown:
        p.error(f"unknown modes: {', '.join(sorted(unknown))}")
    if not args.prompt_sizes:
        p.error("--prompt-tokens needs at least one size")
    budget = max(args.prompt_sizes) + args.turns * (args.max_tokens + 60)
    if budget > 8192 - 64:
        p.error(f"largest prompt plus {args.turns} turns (~{budget} tokens) does not fit in 8192")
    if max(args.io_size_list, default=0) > 8000:
        p.error("--io-sizes must stay below the 8192-token context")
    try:
        args.conc = concurrency_settings(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def concurrency_settings(args: argparse.Namespace) -> dict:
    """The concurrency scenario's settings from the parsed arguments; ValueError if they
    do not make sense."""
    def numbers(text: str, kind=int) -> list:
        return [kind(x) for x in str(text).split(",") if x.strip()]

    users, system, think, batch = (numbers(args.users), numbers(args.system_tokens),
                                   numbers(args.think, float), numbers(args.batched))
    modes = [m.strip() for m in args.conc_modes.split(",") if m.strip()]
    if not users or min(users) < 1:
        raise ValueError("--users needs one or more positive numbers")
    if len(system) != 2 or not 0 < system[0] <= system[1]:
        raise ValueError("--system-tokens needs smallest,largest")
    if len(think) != 2 or not 0 <= think[0] <= think[1]:
        raise ValueError("--think needs min,max seconds")
    if set(modes) - {"a", "b", "c"} or not modes:
        raise ValueError("--conc-modes is a comma list of a, b, c")
    if len(batch) < 3:
        raise ValueError("--batched needs prompt,generated,parallel[,parallel...]")
    if args.slots < 1:
        raise ValueError("--slots must be at least 1")
    if not concurrency.fits(system[1], args.conc_turns, args.conc_max_tokens, args.slot_ctx):
        raise ValueError(f"a {system[1]}-token system prompt plus {args.conc_turns} turns of "
                         f"{args.conc_max_tokens} tokens does not fit a {args.slot_ctx}-token "
                         "slot: raise --slot-ctx")
    return {"users": users, "slots": args.slots, "slot_ctx": args.slot_ctx,
            "system_tokens": system, "turns": args.conc_turns,
            "max_tokens": args.conc_max_tokens, "think": think, "modes": modes,
            "batched": (batch[0], batch[1], batch[2:]), "budget_s": args.conc_budget,
            "proxy_cache_ram": args.proxy_cache_ram,
            "cache_ram_like_gib": args.cache_ram_like_gib,
            "read_timeout": args.read_timeout, "overhead_requests": args.overhead_requests,
            "skip": sorted(args.skip_set)}


def command_line(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m bench.run", *args]).strip()


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if args.from_json:
        run = json.loads(Path(args.from_json).read_text())
        if args.name_given is None:
            args.name = Path(args.from_json).stem
        if "groups" in run:
            return publish_concurrency(run, args, log, args.name)
        return publish(run, args, log)
    signal.signal(signal.SIGTERM, _interrupt)
    code = 0
    if args.scenario in ("all", "main"):
        code = main_scenario(args, argv, log)
        if code == 1:   # interrupted
            return code
    if args.scenario in ("all", "swap"):
        code = max(code, swap_scenario(args, argv, log))
        if code == 1:
            return code
    if args.scenario in ("all", "concurrency"):
        code = max(code, concurrency_scenario(args, argv, log))
    return code


SWAP_START, SWAP_END = "<!-- bench-swap:start -->", "<!-- bench-swap:end -->"


def drop_work(work: Path, keep: bool, log) -> None:
    """A scenario's work folder: removed, or kept (``--keep``) and named."""
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        log(f"kept {work}")


def stamp_end(record: dict, started: float) -> None:
    """The load average at the end and the seconds since ``started``, into ``record``."""
    record["loadavg_end"] = loadavg()
    record["duration_seconds"] = round(time.monotonic() - started, 1)


def swap_scenario(args: argparse.Namespace, argv: list[str] | None, log) -> int:
    """Swap cost with save behind on and off (bench/swap_cost.py); publishes like the others."""
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvproxy-bench-swap-"))
    tokens = args.swap_tokens or (1000 if args.quick else 6000)
    settings = {"tokens": tokens, "turns": args.swap_turns or (3 if args.quick else 6),
                "delay": args.swap_delay, "pause": args.swap_delay + 2.0, "max_tokens": 8,
                "ctx": 8192}
    record: dict = {"scenario": "swap", "command": command_line(argv),
                    "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "machine": machine(), "loadavg_start": loadavg()}
    log(f"\nkvproxy swap cost ({tokens}-token conversations); work folder {work}")
    try:
        record.update(swap_cost.measure(settings, work, log))
    except KeyboardInterrupt:
        log("interrupted")
        return 1
    except (OSError, RuntimeError, ValueError, requests.RequestException) as exc:
        log(f"swap scenario failed: {exc!r}; nothing published (--keep keeps its logs)")
        return 0
    finally:
        drop_work(work, args.keep, log)
    stamp_end(record, started)
    text = swap_cost.text_report(record)
    log("\n" + text)
    name = f"{args.name_given}-swap" if args.name_given else ("swap-quick" if args.quick else "swap")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    m = record["machine"]
    section = "\n".join([
        SWAP_START, "## Swap cost with save behind", "",
        f"Generated by `{record['command']}` on {record['started_at']}, "
        f"{record['duration_seconds']:.0f} s. Raw figures: `bench/results/{name}.json`.", "",
        f"**Machine:** {m['cores']} cores, {m['cpu']}, {m['ram_gib']} GiB RAM; load average "
        f"{' '.join(map(str, record['loadavg_start']))} at start, "
        f"{' '.join(map(str, record['loadavg_end']))} at end.", "",
        f"**Workload:** one llama-server slot, two conversations of about {tokens} tokens "
        f"taking turns, {settings['turns']} turns each, {settings['pause']:.1f} s between "
        f"turns (save-behind delay {settings['delay']} s); every turn after the first two swaps "
        "the slot. Each setting runs on a fresh llama-server and slot folder.", "",
        text, "",
        "- swap: kvproxy's `swap to session=... swap_ms=...` log line, what the incoming "
        "request waited for (a save when there is one, the restore, kvproxy's own calls); "
        "restore and save: llama-server's timings, from the sidecars.", SWAP_END])
    (RESULTS / f"{name}.md").write_text(section + "\n")
    if args.page and report.update_page(PAGE, section, SWAP_START, SWAP_END):
        log("docs/benchmark.md: swap section rewritten")
    log(f"swap target: {record['status']}")
    return 3 if record["status"] == "FAIL" and args.strict else 0


def concurrency_name(args: argparse.Namespace) -> str:
    if args.name_given:
        return f"{args.name_given}-concurrency"
    return "concurrency-quick" if args.quick else "concurrency"


def concurrency_scenario(args: argparse.Namespace, argv: list[str] | None, log) -> int:
    """Several users at once: (a), (b), (c) for each group; publishes like the main scenario."""
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvproxy-bench-conc-"))
    conc: dict = {
        "scenario": "concurrency",
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv), "quick": args.quick, "machine": machine(),
        "loadavg_start": loadavg(), "settings": {k: v for k, v in args.conc.items() if k != "skip"},
        "overhead_recorded": concurrency.recorded_overhead(RESULTS),
    }
    log(f"\nkvproxy concurrency benchmark ({'quick' if args.quick else 'full'}); work folder {work}")
    name = concurrency_name(args)
    try:
        concurrency.run_scenario(args.conc, work, log, conc)
    except KeyboardInterrupt:
        log("interrupted")
        conc["interrupted"] = True
    finally:
        drop_work(work, args.keep, log)
    stamp_end(conc, started)
    if conc.get("interrupted"):
        if not any(g.get("summaries") for g in conc.get("groups") or []):
            return 1
        log("publishing what was measured before the interruption (docs/benchmark.md left alone)")
        publish_concurrency(conc, args, log, name + "-interrupted", page=False)
        return 1
    return publish_concurrency(conc, args, log, name)


def publish_concurrency(conc: dict, args: argparse.Namespace, log, name: str,
                        page: bool | None = None) -> int:
    """Targets, the printed report, results/<name>.json|.png|.md and the docs/benchmark.md section."""
    conc["groups"] = [g for g in conc.get("groups") or [] if g.get("summaries")]
    conc["targets"] = concurrency_targets(conc["groups"], conc["settings"]["slots"],
                                          conc.get("overhead"), conc.get("slot_path"))
    log("\n" + concurrency_report.text_report(conc))
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path, png_path = RESULTS / f"{name}.json", RESULTS / f"{name}.png"
    concurrency_report.plot(conc, png_path)
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(conc, indent=1, default=str))
    os.replace(tmp, json_path)
    log(f"wrote {json_path.relative_to(ROOT)} and {png_path.relative_to(ROOT)}")
    section = concurrency_report.page_section(conc, page_link(png_path))
    (RESULTS / f"{name}.md").write_text(section + "\n")
    if args.page if page is None else page:
        if report.update_page(PAGE, section, concurrency_report.START, concurrency_report.END):
            log("docs/benchmark.md: concurrency section rewritten")
        else:
            log("docs/benchmark.md has no concurrency markers; the section is in "
                f"{(RESULTS / (name + '.md')).relative_to(ROOT)}")
    failed = [t for t in conc["targets"] if t["status"] == "FAIL"]
    log("concurrency targets: " + ", ".join(f"{t['id']} {t['status']}" for t in conc["targets"]))
    return 3 if failed and args.strict else 0


def main_scenario(args: argparse.Namespace, argv: list[str] | None, log) -> int:
    """The restart workload (a), (b), (c) and the micro figures."""
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvproxy-bench-"))
    run: dict = {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv), "quick": args.quick, "machine": machine(),
        "loadavg_start": loadavg(),
        "settings": {k: getattr(args, k) for k in FULL},
        "modes": {}, "workload": {}, "sections": {},
    }
    log(f"kvproxy benchmark ({'quick' if args.quick else 'full'}); work folder {work}")
    log(f"machine: {run['machine']['cores']} cores, {run['machine']['cpu']}, "
        f"{run['machine']['ram_gib']} GiB RAM; load average {run['loadavg_start']}")
    conversations = None
    ok = False
    active: Mode | None = None
    try:
        for key in args.mode_list:
            label, cache_ram, proxied = MODES[key]
            mode = Mode(key, label, work / key, cache_ram, proxied)
            active = mode
            log(f"\n== {label}")
            start_s = mode.start()
            if "build_info" not in run:
                with requests.Session() as http:
                    props = http.get(mode.llama_url + "/props", timeout=10).json()
                run["build_info"] = props.get("build_info")
                run["model"] = os.path.basename(props.get("model_path") or "")
                run["n_ctx"] = (props.get("default_generation_settings") or {}).get("n_ctx")
            if conversations is None:
                with requests.Session() as http:
                    conversations = build_conversations(http, mode.llama_url, args.prompt_sizes,
                                                        args.turns)
                run["conversations"] = [{"name": c.name, "system_tokens": c.system_tokens,
                                         "prompt": c.prompt_group} for c in conversations]
                log("conversations: " + ", ".join(f"{c.name} ({c.prompt_group}, {c.system_tokens} tokens)"
                                                  for c in conversations))
            result, (sent, replies) = run_workload(mode, conversations, args.turns,
                                                   args.restart_after, args.max_tokens,
                                                   args.read_timeout, log)
            account_tokens(result, mode.llama_url, sent, replies)
            if mode.proxy:
                result.metrics_after = scrape_metrics(mode.proxy.url)
                result.sidecars = sidecars(mode.slot_dir)
                # A base snapshot's system prompt is computed before the first request that
                # needs it, outside that request's timings: add it to the workload's total.
                result.computed_tokens += sum(int(s.get("prefill_computed") or 0)
                                              for s in result.sidecars if s.get("kind") == "base")
            run["modes"][key] = {"label": label, "start_seconds": round(start_s, 2),
                                 "cache_ram_mib": cache_ram, "proxied": proxied}
            run["workload"][key] = dataclasses.asdict(result)
            log(f"  [{key}] computed {result.computed_tokens} prompt tokens (minimum "
                f"{result.minimum_tokens}), {result.request_seconds:.1f} s in requests, "
                f"{result.restart_seconds:.1f} s restarting")
            if key == "b":
                if "overhead" not in args.skip_set:
                    log("== proxy overhead without a swap")
                    bare = Proxy(mode.llama_url, str(mode.slot_dir), str(mode.workdir / "bare.log"),
                                 wsgi_app="bench.passthrough:app")
                    try:
                        bare.start(timeout=60)
                        run["sections"]["overhead"] = micro.overhead(
                            mode.proxy.url, mode.llama_url, args.overhead_requests, log, bare.url)
                    finally:
                        bare.stop()
                if "streaming" not in args.skip_set:
                    log("== streaming relay")
                    run["sections"]["streaming"] = micro.streaming(
                        mode.proxy.url, mode.llama_url, args.stream_requests,
                        args.stream_max_tokens, log, args.section_budget)
                if "memory" not in args.skip_set:
                    log("== proxy worker memory")
                    run["sections"]["memory"] = micro.memory(
                        mode.proxy, args.memory_replies, args.memory_max_tokens, log,
                        args.section_budget)
            if key == "a" and "io" not in args.skip_set:
                log("== slot save/restore by file size (on the (a) llama-server)")
                run["sections"]["slot_io"] = micro.slot_io(
                    mode.llama_url, mode.slot_dir, args.io_size_list, args.io_repeats, log)
            mode.stop()
            active = None
        ok = True
    except KeyboardInterrupt:
        log("interrupted")
        run["interrupted"] = True
    finally:
        if active is not None:
            active.stop()
        drop_work(work, args.keep, log)
    if not ok:
        if run["workload"]:
            log("publishing what was measured before the interruption (docs/benchmark.md left alone)")
            args.name, args.page = args.name + "-interrupted", False
            stamp_end(run, started)
            publish(run, args, log)
        return 1

    stamp_end(run, started)
    return publish(run, args, log)


def publish(run: dict, args: argparse.Namespace, log) -> int:
    """Targets, the printed report, results/<name>.json|.png|.md and the docs/benchmark.md section."""
    run["targets"] = report.targets(run)
    text = report.text_report(run)
    log("\n" + text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path, png_path = RESULTS / f"{args.name}.json", RESULTS / f"{args.name}.png"
    report.plot(run, png_path)
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(run, indent=1, default=str))
    os.replace(tmp, json_path)
    log(f"wrote {json_path.relative_to(ROOT)} and {png_path.relative_to(ROOT)}")
    section = report.page_section(run, page_link(png_path))
    (RESULTS / f"{args.name}.md").write_text(section + "\n")
    if args.page:
        if report.update_page(PAGE, section):
            log("docs/benchmark.md: benchmark section rewritten")
        else:
            log("docs/benchmark.md has no <!-- bench:start --> / <!-- bench:end --> markers; the section "
                f"is in {(RESULTS / (args.name + '.md')).relative_to(ROOT)}:\n\n{section}")
    failed = [t for t in run["targets"] if t["status"] == "FAIL"]
    log("targets: " + ", ".join(f"{t['id']} {t['status']}" for t in run["targets"]))
    return 3 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
