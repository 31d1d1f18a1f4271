"""What a swap costs with save behind on and off: ``python -m bench.run --scenario swap``.

One llama-server slot, two conversations with long system prompts taking turns (A, B, A, B,
...), a pause between turns longer than the save-behind delay. Every turn after the first
two swaps the slot: the outgoing session is saved (on the critical path, or already in the
background) and the incoming one restored. Run twice, each on a fresh llama-server and slot
folder: kvproxy with ``KVPROXY_SAVE_BEHIND=true`` and with ``false``.

Per swap it records kvproxy's ``swap to session=... swap_ms=...`` log line (what the request
waited for: the save when there is one, the restore, kvproxy's own calls) and the sidecars'
``restore_ms`` and ``save_ms`` (llama-server's own timings of the parts). Then, with kvproxy
idle, it restores the run's files straight into llama-server and times each call as a client
pays it (round trip included): "a restore alone". The figure: the median swap with save
behind against the median restore alone (issue 21: at most 1.15x); the ratio to
llama-server's own restore time is printed beside it.
"""
from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import requests

from .client import stream_chat
from .procs import Mode
from .readings import sidecar_files
from .workload import text_of_tokens

SWAP_LINE = re.compile(r"swap to session=(?P<session>\S+) source=\S+ cache=(?P<cache>\S+) "
                       r".*?swap_ms=(?P<swap_ms>[\d.]+)")
TARGET_RATIO = 1.15
SESSION_TIMES = ("restores", "restore_ms", "save_ms", "saved_at", "saved_bytes")
SETTINGS = {"on": {"KVPROXY_SAVE_BEHIND": "true"}, "off": {"KVPROXY_SAVE_BEHIND": "false"}}


def swap_lines(log_text: str) -> list[dict]:
    """Every ``swap to session=`` line of kvproxy's log, in order."""
    return [{"session": m["session"], "cache": m["cache"], "swap_ms": float(m["swap_ms"])}
            for m in SWAP_LINE.finditer(log_text)]


def sidecar_times(slot_dir: Path) -> dict[str, dict]:
    """stem -> restores, restore_ms, save_ms, saved_at of every session file."""
    return {data.get("stem") or path.stem: {k: data.get(k) for k in SESSION_TIMES}
            for path, data in sidecar_files(slot_dir) if data.get("kind") == "session"}


def changed(before: dict[str, dict], after: dict[str, dict], field: str) -> list[dict]:
    """Sidecars whose ``field`` changed between two looks."""
    return [after[stem] for stem in after
            if (before.get(stem) or {}).get(field) != after[stem].get(field)]


def recorded_after(slot_dir: Path, before: dict[str, dict], headers) -> dict[str, dict]:
    """The sidecars once the turn's restore is recorded: kvproxy writes it when it closes the
    answer, just after the last byte; waited for at most half a second (well inside the
    save-behind delay, so a background save is never taken for one made during the turn)."""
    deadline = time.monotonic() + 0.5
    while True:
        after = sidecar_times(slot_dir)
        if headers.get("X-KVProxy-Cache") != "restored" or changed(before, after, "restores") \
                or time.monotonic() > deadline:
            return after
        time.sleep(0.01)


def run_setting(key: str, work: Path, systems: list[str] | None, settings: dict, log) -> dict:
    """One kvproxy setting (``on`` or ``off``) on a fresh stack: every swap's parts."""
    env = {"KVPROXY_SLOTS": "1", "KVPROXY_SAVE_BEHIND_DELAY": str(settings["delay"]),
           **SETTINGS[key]}
    mode = Mode(f"swap-{key}", f"save behind {key}", work / key, None, True,
                llama_options={"ctx_size": settings["ctx"], "cache_ram_mib": 0}, proxy_env=env)
    rows: list[dict] = []
    try:
        mode.start()
        with requests.Session() as http:
            if systems is None:
                systems = [text_of_tokens(http, mode.llama_url, settings["tokens"], 7100 + i)[0]
                           for i in range(2)]
            histories = [[{"role": "system", "content": s}] for s in systems]
            for turn in range(settings["turns"] * 2):
                who = turn % 2
                messages = histories[who] + [{"role": "user", "content":
                                              f"Turn {turn // 2 + 1}: name one rule, briefly."}]
                before = sidecar_times(mode.slot_dir)
                answer = stream_chat(http, mode.url, {"messages": messages, "max_tokens":
                                                      settings["max_tokens"], "temperature": 0,
                                                      "seed": 42}, read_timeout=600)
                if answer.status != 200 or answer.error:
                    raise RuntimeError(f"turn {turn + 1}: {answer.status} {answer.error}")
                after = recorded_after(mode.slot_dir, before, answer.headers)
                histories[who] = messages + [{"role": "assistant", "content": answer.content}]
                restored = changed(before, after, "restores")
                saved = changed(before, after, "saved_at")
                rows.append({"turn": turn + 1, "conversation": "AB"[who],
                             "cache": answer.headers.get("X-KVProxy-Cache"),
                             "ttft_s": answer.first_token,
                             "restore_ms": restored[0]["restore_ms"] if restored else None,
                             "save_on_path_ms": saved[0]["save_ms"] if saved else None})
                log(f"  [{key}] turn {turn + 1} ({'AB'[who]}): cache "
                    f"{rows[-1]['cache']}, restore_ms {rows[-1]['restore_ms']}, save during the "
                    f"request {rows[-1]['save_on_path_ms']}")
                # Longer than the delay plus a save: the background save is done by the next turn.
                time.sleep(settings["pause"])
        lines = swap_lines(Path(mode.proxy.log_path).read_text(errors="replace"))
        background = sidecar_times(mode.slot_dir)
        alone = restores_alone(mode.llama_url, list(background), settings.get("alone", 10))
    finally:
        mode.stop()
    restored_lines = [line for line in lines if line["cache"] == "restored"]
    restored_rows = [r for r in rows if r["cache"] == "restored"]
    for row, line in zip(restored_rows, restored_lines):
        row["swap_ms"] = line["swap_ms"]
    return {"env": env, "turns": rows, "systems": systems,
            "file_mb": round(max((s.get("saved_bytes") or 0) for s in background.values()) / 1e6, 1)
            if background else None,
            "summary": {**summarize(restored_rows),
                        "restore_call_ms": round(statistics.median(alone), 2) if alone else None},
            "restores_alone_ms": alone}


def restores_alone(llama_url: str, stems: list[str], rounds: int) -> list[float]:
    """A restore alone, as any client of llama-server pays it: the wall time of
    ``POST /slots/0?action=restore`` of the run's session files in turn (round trip included),
    with kvproxy idle."""
    times = []
    with requests.Session() as http:
        for i in range(rounds if stems else 0):
            started = time.perf_counter()
            reply = http.post(f"{llama_url}/slots/0?action=restore",
                              json={"filename": f"{stems[i % len(stems)]}.bin"}, timeout=120)
            elapsed = (time.perf_counter() - started) * 1000
            if reply.status_code == 200:
                times.append(round(elapsed, 2))
    return times


def summarize(rows: list[dict]) -> dict:
    def median(key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.median(values), 2) if values else None
    return {"swaps": len(rows), "swap_ms": median("swap_ms"), "restore_ms": median("restore_ms"),
            "save_on_path_ms": median("save_on_path_ms"),
            "saves_on_path": sum(1 for r in rows if r.get("save_on_path_ms") is not None)}


def measure(settings: dict, work: Path, log) -> dict:
    """Both settings, save behind on first; the figures and the verdict."""
    result: dict = {"settings": settings, "runs": {}}
    systems = None
    for key in ("on", "off"):
        log(f"== swap cost, save behind {key}")
        run = run_setting(key, work, systems, settings, log)
        systems = run.pop("systems")
        result["runs"][key] = run
    on, off = result["runs"]["on"]["summary"], result["runs"]["off"]["summary"]
    result["ratio_on"] = ratio(on["swap_ms"], on["restore_call_ms"])
    result["ratio_off"] = ratio(off["swap_ms"], off["restore_call_ms"])
    result["ratio_on_inside"] = ratio(on["swap_ms"], on["restore_ms"])
    result["status"] = "PASS" if result["ratio_on"] is not None and \
        result["ratio_on"] <= TARGET_RATIO else "FAIL"
    return result


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def text_report(result: dict) -> str:
    rows = [("median swap (kvproxy's swap_ms), ms", "swap_ms"),
            ("median restore alone (POST /slots/0?action=restore, wall time), ms",
             "restore_call_ms"),
            ("median restore inside llama-server (its restore_ms), ms", "restore_ms"),
            ("median save during the request, ms", "save_on_path_ms"),
            ("swaps that saved during the request", "saves_on_path"),
            ("swaps measured", "swaps")]
    on, off = result["runs"]["on"], result["runs"]["off"]
    lines = ["| | save behind on | save behind off (KVPROXY_SAVE_BEHIND=false) |",
             "| --- | --- | --- |"]
    for label, key in rows:
        lines.append(f"| {label} | {_v(on['summary'][key])} | {_v(off['summary'][key])} |")
    lines.append(f"| swap / restore alone | **{_v(result['ratio_on'])}x** | {_v(result['ratio_off'])}x |")
    lines.append("")
    lines.append(f"Target (issue 21): a swap whose outgoing session was saved behind costs at most "
                 f"{TARGET_RATIO}x a restore alone: **{result['status']}** "
                 f"({_v(result['ratio_on'])}x; {on['file_mb']} MB session files). Against "
                 f"llama-server's own restore time, without the round trip any call pays: "
                 f"{_v(result.get('ratio_on_inside'))}x.")
    return "\n".join(lines)


def _v(value) -> str:
    return "-" if value is None else str(value)
