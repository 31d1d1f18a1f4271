"""Do conversations resident in other slots slow the active one? ``python -m
bench.idle_residents`` (``make bench-idle-residents``).

kvproxy keeps up to ``-np`` conversations in llama-server's slots on purpose. llama.cpp
measured that the idle cells of other slots in a unified KV cache slow the active slot's
attention (upstream #20993, ``--cache-idle-slots``). Here one llama-server with 4 slots
answers the same prompt in slot 0 (``cache_prompt`` false, so it is prefilled every time,
and a fixed number of generated tokens) with slots 1-3 each holding a long conversation
("resident") and with them erased ("erased"), the two alternated round by round
(resident first in even rounds, erased first in odd ones). llama-server's own ``timings``
give the prefill and decode speeds; the load average is recorded with each answer.

Two layouts, each on a llama-server of its own with ``--cache-ram 0``, as kvproxy runs
several slots: kvproxy's (``-np 4``: a KV stream per slot) and ``--kv-unified`` (one pool
for every slot, what upstream measured; with a RAM cache llama-server would itself empty
the idle slots of that pool at each new task).

The residents are filled once by requests pinned with ``id_slot``, saved to files and
restored before every "resident" answer; those restores are timed too: they are what
erasing a saved conversation costs when it comes back. Figures go to
``bench/results/idle-residents.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import requests

from kvproxy.launch.processes import LlamaServer

from .client import CONNECT_TIMEOUT
from .readings import cores_and_load
from .report import RESULTS
from .workload import text_of_tokens

READ_TIMEOUT = 600            # one request or slot action, however loaded the machine
LAYOUTS = {"separate": ("kvproxy's: -np 4, a KV stream per slot", []),
           "unified": ("--kv-unified: one KV pool for the 4 slots", ["--kv-unified"])}
RESIDENT_SLOTS = (1, 2, 3)
QUESTION = "Summarise the three most important rules in one paragraph."


# -- llama-server ------------------------------------------------------------
def post(http: requests.Session, url: str, body: dict) -> dict:
    response = http.post(url, json=body, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
    return response.json()


def answer(http: requests.Session, url: str, slot: int, system: str, max_tokens: int,
           cold: bool) -> dict:
    """One chat answer pinned to ``slot``; ``cold``: prefill every token, generate exactly
    ``max_tokens``. Returns llama-server's timings."""
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": QUESTION}],
            "id_slot": slot, "max_tokens": max_tokens, "temperature": 0}
    if cold:
        body.update(cache_prompt=False, ignore_eos=True)
    return post(http, url + "/v1/chat/completions", body)["timings"]


def slot_action(http: requests.Session, url: str, slot: int, action: str,
                filename: str | None = None) -> dict:
    return post(http, f"{url}/slots/{slot}?action={action}",
                {"filename": filename} if filename else {})


def place_residents(http: requests.Session, url: str, resident: bool) -> dict:
    """Restore the residents' files into slots 1-3, or erase those slots: what it took."""
    started = time.perf_counter()
    if resident:
        done = [slot_action(http, url, s, "restore", f"resident-{s}.bin") for s in RESIDENT_SLOTS]
        return {"tokens": sum(d["n_restored"] for d in done),
                "restore_ms": [round(d["timings"]["restore_ms"], 2) for d in done],
                "wall_ms": round((time.perf_counter() - started) * 1000, 2)}
    done = [slot_action(http, url, s, "erase") for s in RESIDENT_SLOTS]
    return {"tokens": 0, "erased": sum(d["n_erased"] for d in done),
            "wall_ms": round((time.perf_counter() - started) * 1000, 2)}


def measure_layout(layout: str, work: Path, texts: dict, args) -> dict:
    """Fill the residents, then ``args.rounds`` rounds of both conditions on one layout."""
    label, extra = LAYOUTS[layout]
    folder = work / layout
    threads = ["--threads", str(args.threads)] if args.threads else []
    llama = LlamaServer(str(folder), slots=4, ctx_size=args.ctx, cache_ram_mib=0,
                        extra_args=extra + threads, log_path=str(work / f"llama-{layout}.log"))
    print(f"== {label} (-c {args.ctx}); filling slots 1-3 ...", flush=True)
    llama.start(timeout=180)
    try:
        with requests.Session() as http:
            files = {}
            for slot, system in zip(RESIDENT_SLOTS, texts["residents"]):
                answer(http, llama.url, slot, system, 16, cold=False)
                saved = slot_action(http, llama.url, slot, "save", f"resident-{slot}.bin")
                files[slot] = {"tokens": saved["n_saved"], "bytes": saved["n_written"],
                               "save_ms": round(saved["timings"]["save_ms"], 2)}
            rounds = []
            for number in range(args.rounds):
                order = (True, False) if number % 2 == 0 else (False, True)
                for resident in order:
                    placed = place_residents(http, llama.url, resident)
                    load = os.getloadavg()[0]
                    timings = answer(http, llama.url, 0, texts["active"], args.decode, cold=True)
                    row = {"layout": layout, "round": number,
                           "condition": "resident" if resident else "erased",
                           "idle_tokens": placed["tokens"], "placed": placed,
                           "loadavg_1m": round(load, 2),
                           "prompt_n": timings["prompt_n"], "predicted_n": timings["predicted_n"],
                           "prompt_per_second": round(timings["prompt_per_second"], 2),
                           "predicted_per_second": round(timings["predicted_per_second"], 2),
                           "answer_s": round((timings["prompt_ms"] + timings["predicted_ms"])
                                             / 1000, 3)}
                    rounds.append(row)
                    print(f"  round {number} {row['condition']:8} idle tokens "
                          f"{row['idle_tokens']:5}: prefill {row['prompt_per_second']:7.1f} "
                          f"tok/s, decode {row['predicted_per_second']:6.1f} tok/s, "
                          f"load {load:.2f}", flush=True)
            return {"label": label, "command": command_line(llama),
                    "files": files, "rounds": rounds}
    finally:
        llama.stop()


def command_line(llama: LlamaServer) -> str:
    """llama-server's flags without this machine's paths and ports."""
    words, shown = llama.command()[1:], ["llama-server"]
    for word in words:
        if shown[-1] in ("--host", "--port"):
            shown.pop()
        elif word == llama.model:
            shown.append(Path(word).name)
        else:
            shown.append("DIR" if word == llama.slot_dir else word)
    return " ".join(shown)


# -- figures -----------------------------------------------------------------
def summary(rounds: list[dict]) -> dict:
    """Medians per condition, and the medians of each round's resident / erased ratio (the
    two answers of a round ran next to each other, so the machine's load hit both alike)."""
    out: dict = {}
    for condition in ("resident", "erased"):
        rows = [r for r in rounds if r["condition"] == condition]
        out[condition] = {key: round(statistics.median(r[key] for r in rows), 3)
                          for key in ("prompt_per_second", "predicted_per_second", "answer_s",
                                      "loadavg_1m", "idle_tokens")}
    pairs = {}
    for r in rounds:
        pairs.setdefault(r["round"], {})[r["condition"]] = r
    pairs = [p for p in pairs.values() if len(p) == 2]
    out["ratio"] = {key: round(statistics.median(p["resident"][key] / p["erased"][key]
                                                 for p in pairs), 3)
                    for key in ("prompt_per_second", "predicted_per_second", "answer_s")}
    out["answer_s_saved"] = round(statistics.median(
        p["resident"]["answer_s"] - p["erased"]["answer_s"] for p in pairs), 3)
    restores = [ms for r in rounds if r["condition"] == "resident"
                for ms in r["placed"]["restore_ms"]]
    out["restore_ms"] = round(statistics.median(restores), 2) if restores else None
    out["rounds"] = len(pairs)
    return out


def table(run: dict) -> str:
    lines = ["| layout | slots 1-3 | prefill tokens/s | decode tokens/s | answer s | "
             "load avg (1 min) |", "| --- | --- | --- | --- | --- | --- |"]
    for layout, measured in run["layouts"].items():
        s = summary(measured["rounds"])
        for condition in ("resident", "erased"):
            c = s[condition]
            idle = f"{c['idle_tokens']:.0f} tokens resident" if condition == "resident" \
                else "erased"
            lines.append(f"| {measured['label']} | {idle} | {c['prompt_per_second']:.1f} | "
                         f"{c['predicted_per_second']:.1f} | {c['answer_s']:.2f} | "
                         f"{c['loadavg_1m']:.2f} |")
        r = s["ratio"]
        lines.append(f"| | **resident / erased** (median of {s['rounds']} rounds) | "
                     f"**{r['prompt_per_second']:.3f}x** | **{r['predicted_per_second']:.3f}x** "
                     f"| {r['answer_s']:.3f}x ({s['answer_s_saved']:+.2f} s) | |")
    return "\n".join(lines)


def notes(run: dict) -> str:
    lines = []
    for layout, measured in run["layouts"].items():
        s = summary(measured["rounds"])
        files = measured["files"].values()
        lines.append(f"- {layout}: `{measured['command']}`; resident files "
                     f"{', '.join(str(f['tokens']) for f in files)} tokens "
                     f"({sum(f['bytes'] for f in files) / 1e6:.0f} MB in all), restore of one: "
                     f"median {s['restore_ms']} ms (llama-server's restore_ms)")
    return "\n".join(lines)


def report(run: dict) -> str:
    a = run["args"]
    return "\n".join([
        f"Measured {run['date']} on {run['machine']['cores']} cores ({run['machine']['cpu']}), "
        f"{run['duration_s']:.0f} s. Slot 0: a {run['active_tokens']}-token prompt prefilled "
        f"each time, {a['decode']} tokens generated; slots 1-3: about {a['resident_tokens']} "
        f"tokens each, or erased; {a['rounds']} rounds, alternated.", "",
        table(run), "", notes(run)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=16384, help="llama-server -c (4 slots)")
    parser.add_argument("--resident-tokens", type=int, default=2500,
                        help="system prompt of each resident conversation")
    parser.add_argument("--active-tokens", type=int, default=1500,
                        help="system prompt of the active conversation")
    parser.add_argument("--decode", type=int, default=128, help="tokens generated per answer")
    parser.add_argument("--layouts", default="separate,unified")
    parser.add_argument("--threads", type=int, help="llama-server --threads (default: its own); "
                        "1 keeps a loaded machine from stalling its threads at each barrier")
    parser.add_argument("--name", default="idle-residents", help="bench/results/<name>.json, .md")
    args = parser.parse_args(argv)
    started = time.monotonic()
    run = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args),
           "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="kvproxy-idle-residents-") as work:
        with LlamaServer(str(Path(work) / "tokenizer"), slots=1, ctx_size=2048,
                         cache_ram_mib=0) as llama, requests.Session() as http:
            residents = [text_of_tokens(http, llama.url, args.resident_tokens, 500 + s)[0]
                         for s in RESIDENT_SLOTS]
            active, run["active_tokens"] = text_of_tokens(http, llama.url, args.active_tokens, 7)
        texts = {"residents": residents, "active": active}
        for layout in args.layouts.split(","):
            run["layouts"][layout] = measure_layout(layout, Path(work), texts, args)
    run["duration_s"] = round(time.monotonic() - started, 1)
    run["machine"] = cores_and_load()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")
    (RESULTS / f"{args.name}.md").write_text(report(run) + "\n", encoding="utf-8")
    print("\n" + report(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
