"""Sessions as shared chunks against whole files: ``make bench-chunks``.

Each case runs on a fresh llama-server (the bundled model) and kvproxy under gunicorn, once
with ``KVPROXY_SESSION_STORE=files`` and once with ``chunks`` (at several chunk sizes), in
the same run:

- ``six``: six conversations behind one 3,500-token system prompt, each with its own
  350-token first message, one slot. Their first turns, then every second turn (each a
  restore). Read: the slot folder's allocated bytes against the bytes of the conversations'
  tokens as whole files, the share of each second turn's prompt reused, and what one more
  settled turn wrote to disk (``write_bytes`` less ``cancelled_write_bytes`` of llama-server
  and kvproxy's worker, from the turn until its background save is stored).
- ``ten``: ten conversations behind a 6,000-token prompt, one slot: disk bytes, bytes
  written per turn, and each returning turn's restore (kvproxy's ``swap_ms``: assembly and
  llama-server's restore) against whole files of the same size.
- ``gap``: two slots; one conversation streams its answer while the other's background save
  runs: the longest gap between two streamed tokens, against the stream's median gap.

Figures go to ``bench/results/chunks.json`` and ``chunks.md`` and to docs/benchmark.md between
its ``bench-chunks`` markers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import requests

from bench.client import session_turn, stream_chat
from bench.procs import Mode
from bench.readings import machine, sidecar_files
from bench.report import RESULTS, put_on_page, write_figures
from bench.workload import text_of_tokens

START, END = "<!-- bench-chunks:start -->", "<!-- bench-chunks:end -->"
READ_TIMEOUT = 600
SETTLE_DELAY = "0.5"      # KVPROXY_SAVE_BEHIND_DELAY: saves start soon after each turn
SAVE_TIMEOUT = 180.0
SWAP_MS = re.compile(r"swap to session=(?P<session>\S+) source=\S+ cache=(?P<cache>\S+) "
                     r".*?swap_ms=(?P<swap_ms>[\d.]+)")


# -- readings -------------------------------------------------------------------------------
def allocated_bytes(folder: Path) -> int:
    """Bytes the folder takes on disk (allocated blocks), every inode counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def io_counts(pids: list[int]) -> tuple[int, int]:
    """``write_bytes`` and ``cancelled_write_bytes`` of /proc/<pid>/io, summed."""
    written = cancelled = 0
    for pid in pids:
        fields = {}
        with open(f"/proc/{pid}/io", encoding="ascii") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                fields[key] = int(value)
        written += fields["write_bytes"]
        cancelled += fields["cancelled_write_bytes"]
    return written, cancelled


def disk_written(pids: list[int]) -> int:
    """Bytes these processes sent (or will send) to the disk: ``write_bytes`` less
    ``cancelled_write_bytes`` (a file deleted before its dirty pages were written back costs
    nothing)."""
    written, cancelled = io_counts(pids)
    return written - cancelled


def session_sidecar(slot_dir: Path, session: str) -> dict | None:
    for _path, data in sidecar_files(slot_dir):
        if data.get("kind") == "session" and data.get("session_id") == session:
            return data
    return None


def wait_stored(slot_dir: Path, session: str, before: str | None, chunked: bool) -> dict:
    """The session's sidecar once a save newer than ``before`` is stored (as chunks when the
    store cuts it)."""
    deadline = time.monotonic() + SAVE_TIMEOUT
    while time.monotonic() < deadline:
        data = session_sidecar(slot_dir, session)
        if data and data.get("saved_at") != before and \
                (not chunked or data.get("stored_as") == "chunks"):
            return data
        time.sleep(0.05)
    raise TimeoutError(f"{session}: no save stored within {SAVE_TIMEOUT:.0f} s")


def chat(url: str, session: str, messages: list[dict], max_tokens: int = 24) -> dict:
    """One turn (temperature 0): reply, prompt and reused tokens, kvproxy's cache header."""
    return session_turn(url, session, messages, max_tokens, READ_TIMEOUT)


def swap_ms(log_path: Path) -> dict[str, list[float]]:
    """session -> swap_ms of each restore kvproxy logged for it."""
    out: dict[str, list[float]] = {}
    for m in SWAP_MS.finditer(log_path.read_text(errors="replace")):
        if m["cache"] == "restored":
            out.setdefault(m["session"], []).append(float(m["swap_ms"]))
    return out


# -- the stack ------------------------------------------------------------------------------
class Stack:
    """llama-server plus kvproxy, one store setting, a fresh slot folder."""

    def __init__(self, work: Path, store: str, chunk_tokens: int, slots: int = 1,
                 ctx: int = 8192, hot: Path | None = None):
        work.mkdir(parents=True, exist_ok=True)
        env = {"KVPROXY_SESSION_STORE": store, "KVPROXY_CHUNK_TOKENS": str(chunk_tokens),
               "KVPROXY_SLOTS": str(slots), "KVPROXY_SAVE_BEHIND_DELAY": SETTLE_DELAY,
               "KVPROXY_SLOT_KEEP": "0", **({"KVPROXY_HOT_DIR": str(hot)} if hot else {})}
        self.store = store
        self.mode = Mode(f"{store}-{chunk_tokens}", store, work, None, True,
                         llama_options={"ctx_size": ctx * slots, "cache_ram_mib": 0,
                                        "slots": slots}, proxy_env=env)
        self.slot_dir = self.mode.slot_dir
        self.log_path = work / "proxy.log"

    def __enter__(self) -> "Stack":
        self.mode.start()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.stop()

    @property
    def url(self) -> str:
        return self.mode.url

    def pids(self) -> list[int]:
        return [self.mode.llama.process.pid, self.mode.proxy.worker_pid()]

    def turn(self, session: str, messages: list[dict], max_tokens: int = 24) -> dict:
        """One turn and its background save, stored: the reply's figures, the bytes the
        processes wrote to disk meanwhile and the sidecar of the save."""
        before = (session_sidecar(self.slot_dir, session) or {}).get("saved_at")
        pids = self.pids()
        os.sync()
        counts = [io_counts([pid]) for pid in pids]
        result = chat(self.url, session, messages, max_tokens)
        sidecar = wait_stored(self.slot_dir, session, before, self.store == "chunks")
        os.sync()
        # per process (llama-server, kvproxy): bytes dirtied and bytes cancelled meanwhile
        result["io"] = [[after[0] - was[0], after[1] - was[1]]
                        for was, after in zip(counts, (io_counts([pid]) for pid in pids))]
        result["dirtied"] = sum(w for w, _ in result["io"])
        result["written"] = result["dirtied"] - sum(c for _, c in result["io"])
        result["n_tokens"] = sidecar.get("n_tokens")
        result["file_bytes"] = sidecar.get("n_bytes")
        return result


def prompts(llama_url: str, system_tokens: int, first_tokens: int, count: int, seed: int
            ) -> tuple[str, list[str]]:
    with requests.Session() as http:
        system, _ = text_of_tokens(http, llama_url, system_tokens, seed)
        firsts = [text_of_tokens(http, llama_url, first_tokens, seed + 1 + i)[0]
                  for i in range(count)]
    return system, firsts


def conversations(stack: Stack, system: str, firsts: list[str], name: str) -> dict:
    """First turns of every conversation, then their second turns (each a restore on one
    slot): per turn the cache header, prompt, reused tokens and bytes written."""
    history: dict[str, list[dict]] = {}
    first, second = [], []
    for i, text in enumerate(firsts):
        session = f"{name}-{i}"
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"{text}\nSum it up in one line."}]
        row = stack.turn(session, messages)
        history[session] = messages + [{"role": "assistant", "content": row["reply"]}]
        first.append(row)
    for session, messages in history.items():
        messages = messages + [{"role": "user", "content": "And in one word?"}]
        row = stack.turn(session, messages)
        history[session] = messages + [{"role": "assistant", "content": row["reply"]}]
        second.append({**row, "session": session})
    return {"first": first, "second": second, "history": history}


def whole_bytes(rows: list[dict]) -> int:
    """The bytes of these saves' tokens as whole slot files (llama-server's own count)."""
    return sum(r["file_bytes"] or 0 for r in rows)


# -- cases ----------------------------------------------------------------------------------
def case_six(work: Path, store: str, chunk_tokens: int, system: str, firsts: list[str]) -> dict:
    with Stack(work, store, chunk_tokens) as stack:
        run = conversations(stack, system, firsts, "six")
        folder = allocated_bytes(stack.slot_dir)
        # one more settled turn of the conversation in the slot (no restore: only its save)
        last = run["second"][-1]["session"]
        messages = run["history"][last] + [{"role": "user", "content": "Thanks. Once more?"}]
        more = stack.turn(last, messages)
    tokens_bytes = whole_bytes(run["second"])
    per_token = tokens_bytes / sum(r["n_tokens"] for r in run["second"])
    new_tokens = more["n_tokens"] - run["second"][-1]["n_tokens"]
    return {
        "store": store, "chunk_tokens": chunk_tokens,
        "folder_bytes": folder, "tokens_whole_bytes": tokens_bytes,
        "folder_ratio": round(folder / tokens_bytes, 3),
        "bytes_per_token": round(per_token),
        "second_reuse": [round(r["reused_tokens"] / r["prompt_tokens"], 3) for r in run["second"]],
        "second_cache": [r["cache"] for r in run["second"]],
        "more_new_tokens": new_tokens, "more_written": more["written"],
        "more_dirtied": more["dirtied"],
        "more_bound": round((new_tokens + 512) * per_token * 1.2),
        "second_written": [r["written"] for r in run["second"]],
        "second_io": [r["io"] for r in run["second"]], "more_io": more["io"],
    }


def memory_folder() -> str | None:
    """A tmpfs folder to make temporary folders in (None: the default temporary folder)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only), so the next restore reads the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def case_ten(work: Path, store: str, chunk_tokens: int, system: str, firsts: list[str],
             hot: Path | None = None) -> dict:
    """First and second turns (restores from the page cache), then third turns with the page
    cache dropped before each (restores from the disk, where the machine allows it; hot
    copies, ``hot``, are in memory and stay)."""
    with Stack(work, store, chunk_tokens, hot=hot) as stack:
        run = conversations(stack, system, firsts, "ten")
        folder = allocated_bytes(stack.slot_dir)
        cold = []
        for session, messages in run["history"].items():
            if not drop_page_cache():
                break
            cold.append(stack.turn(session, messages + [{"role": "user", "content": "Why?"}]))
        restores = swap_ms(stack.log_path)
    seconds = [r["seconds"] for r in run["second"]]
    restore = [restores[r["session"]][0] for r in run["second"] if restores.get(r["session"])]
    restore_cold = [restores[r["session"]][1] for r in run["second"]
                    if len(restores.get(r["session"]) or ()) > 1] if cold else []
    return {
        "restore_cold_ms": restore_cold,
        "restore_cold_ms_median": statistics.median(restore_cold) if restore_cold else None,
        "cold_reuse": [round(r["reused_tokens"] / r["prompt_tokens"], 3) for r in cold],
        "store": store + (", hot copies" if hot else ""), "chunk_tokens": chunk_tokens,
        "folder_bytes": folder, "tokens_whole_bytes": whole_bytes(run["second"]),
        "written_first_turns": [r["written"] for r in run["first"]],
        "written_second_turns": [r["written"] for r in run["second"]],
        "io_second_turns": [r["io"] for r in run["second"]],
        "restore_ms": restore, "restore_ms_median": statistics.median(restore) if restore else None,
        "turn_s_median": statistics.median(seconds),
        "second_reuse": [round(r["reused_tokens"] / r["prompt_tokens"], 3) for r in run["second"]],
        "second_cache": [r["cache"] for r in run["second"]],
    }


def case_gap(work: Path, store: str, chunk_tokens: int, system: str, firsts: list[str],
             answer_tokens: int, folder: str = "disk") -> dict:
    """Conversation B streams while conversation A's background save runs in the other slot;
    ``folder`` "tmpfs": the slot folder (where llama-server writes) in memory."""
    with Stack(work, store, chunk_tokens, slots=2) as stack:
        a = [{"role": "system", "content": system}, {"role": "user", "content": firsts[0]}]
        b = [{"role": "system", "content": system + " (b)"}, {"role": "user", "content": firsts[1]}]
        stack.turn("gap-b", b)
        quiet = stream(stack.url, "gap-b", b + [{"role": "user", "content": "Go on, at length."}],
                       answer_tokens)
        before = (session_sidecar(stack.slot_dir, "gap-a") or {}).get("saved_at")
        chat(stack.url, "gap-a", a)      # its save starts SETTLE_DELAY s after the answer
        during = stream(stack.url, "gap-b", b + [{"role": "user", "content": "Go on, longer."}],
                        answer_tokens)
        saved = wait_stored(stack.slot_dir, "gap-a", before, store == "chunks")
    saved_at = datetime.fromisoformat(saved["saved_at"]).timestamp()
    return {"store": store, "folder": folder, "quiet": quiet, "during": during,
            "save_in_stream": during["from"] <= saved_at <= during["to"],
            "save_ms": saved.get("save_ms"), "saved_bytes": saved.get("n_bytes")}


def stream(url: str, session: str, messages: list[dict], max_tokens: int) -> dict:
    began = time.time()
    with requests.Session() as http:
        http.headers["X-Session-Id"] = session
        result = stream_chat(http, url, {"model": "m", "messages": messages, "temperature": 0,
                                         "max_tokens": max_tokens, "ignore_eos": True},
                             read_timeout=READ_TIMEOUT)
    if result.error:
        raise RuntimeError(f"{session}: {result.error}")
    times = [t for t in result.event_times if t is not None]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"events": len(times), "from": began, "to": time.time(),
            "longest_gap_ms": round(max(gaps) * 1000, 1) if gaps else None,
            "median_gap_ms": round(statistics.median(gaps) * 1000, 2) if gaps else None}


# -- report ---------------------------------------------------------------------------------
def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def report(run: dict) -> str:
    lines = [START, "## Sessions as chunks against whole files (`make bench-chunks`)", "",
             f"Run {run['started']} on {run['machine'].get('cpu', '?')}"
             + "".join(f" ({what} {run[key]})" for key, what in (
                 ("six_started", "the six conversations"), ("gap_started", "the gap case"))
                 if run.get(key))
             + "; bundled model (SmolLM2-135M), llama-server's own files, one kvproxy under "
             "gunicorn, each case on a fresh llama-server and slot folder; save behind after "
             f"{SETTLE_DELAY} s. Load average at the end: {run.get('load', '?')}.", ""]
    six = run.get("six") or []
    if six:
        lines += ["### Six conversations behind a 3,500-token prompt (one slot)", "",
                  "| store | chunk | folder | x tokens' whole files | second turns reused "
                  "(min) | one more turn: new tokens, written, bound |",
                  "|---|---:|---:|---:|---:|---|"]
        for r in six:
            lines.append(
                f"| {r['store']} | {r['chunk_tokens'] if r['store'] == 'chunks' else '-'} | "
                f"{_mb(r['folder_bytes'])} | {r['folder_ratio']:.2f}x | "
                f"{min(r['second_reuse']):.1%} | {r['more_new_tokens']} tokens, "
                f"{_mb(r['more_written'])} of {_mb(r['more_dirtied'])} dirtied "
                f"(bound {_mb(r['more_bound'])}) |")
        lines.append("")
    ten = run.get("ten") or []
    if ten:
        lines += ["### Ten conversations behind a 6,000-token prompt (one slot)", "",
                  "| store | folder | written per first turn (median) | written per second "
                  "turn (median) | restore from the page cache (median) | restore from the "
                  "disk (median) | returning turns reused (min) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in ten:
            cold = r.get("restore_cold_ms_median")
            lines.append(
                f"| {r['store']} | {_mb(r['folder_bytes'])} | "
                f"{_mb(statistics.median(r['written_first_turns']))} | "
                f"{_mb(statistics.median(r['written_second_turns']))} | "
                f"{r['restore_ms_median']:.0f} ms | {'-' if cold is None else f'{cold:.0f} ms'} | "
                f"{min(r['second_reuse'] + r.get('cold_reuse', [])):.1%} |")
        files = next((r for r in ten if r["store"] == "files"), None)
        for chunks in (r for r in ten if r["store"] != "files"):
            if not (files and files["restore_ms_median"]):
                break
            ratio = f"{chunks['restore_ms_median'] / files['restore_ms_median']:.2f}x"
            if files.get("restore_cold_ms_median") and chunks.get("restore_cold_ms_median"):
                cold = chunks["restore_cold_ms_median"] / files["restore_cold_ms_median"]
                ratio += f" from the page cache, {cold:.2f}x from the disk"
            how = "from hot copies" if "hot" in chunks["store"] else "from chunks"
            lines += ["", f"A restore {how} against a whole file of the same size: {ratio}."]
        lines.append("")
    gap = run.get("gap") or []
    if gap:
        lines += ["### Another slot's stream while a save runs (two slots)", "",
                  "| store | slot folder | save (llama-server) | longest gap during the save | "
                  "longest gap, no save | median gap |", "|---|---|---:|---:|---:|---:|"]
        for r in gap:
            where = r["folder"] + ("" if r["save_in_stream"] else " (save outside the stream)")
            lines.append(f"| {r['store']} | {where} | "
                         f"{r['save_ms']:.0f} ms, {_mb(r['saved_bytes'])} | "
                         f"{r['during']['longest_gap_ms']:.0f} ms | "
                         f"{r['quiet']['longest_gap_ms']:.0f} ms | "
                         f"{r['during']['median_gap_ms']:.1f} ms |")
        lines.append("")
    return "\n".join(lines + [END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="six,ten,gap", help="comma-separated: six, ten, gap")
    parser.add_argument("--chunk-sizes", default="128,256,512",
                        help="chunk sizes the six case tries (the others use 256)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="prompt sizes times this (a smoke run: 0.2)")
    parser.add_argument("--answer-tokens", type=int, default=400,
                        help="tokens the gap case streams")
    parser.add_argument("--out", default=str(RESULTS / "chunks"),
                        help="where the figures go (.json and .md are added)")
    parser.add_argument("--no-page", action="store_true", help="leave docs/benchmark.md alone")
    parser.add_argument("--from-json", help="render saved figures again, start nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        run = json.loads(Path(args.from_json).read_text())
        print(report(run))
        if not args.no_page:
            put_on_page(report(run), START, END)
        return 0
    cases = set(args.cases.split(","))
    sizes = [int(s) for s in args.chunk_sizes.split(",")]
    run: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "machine": machine(), "scale": args.scale}
    with tempfile.TemporaryDirectory(prefix="kvproxy-bench-chunks-") as tmp:
        work = Path(tmp)
        scaled = lambda n: max(32, int(n * args.scale))   # noqa: E731
        with Stack(work / "tokenizer", "files", 256) as probe:
            six_prompts = prompts(probe.mode.llama_url, scaled(3500), scaled(350), 6, 3500)
            ten_prompts = prompts(probe.mode.llama_url, scaled(6000), scaled(350), 10, 6000)
        if "six" in cases:
            run["six"] = []
            for store, size in [("files", 256)] + [("chunks", s) for s in sizes]:
                print(f"== six: {store} {size}", flush=True)
                run["six"].append(case_six(work / f"six-{store}-{size}", store, size, *six_prompts))
                print(json.dumps(run["six"][-1]), flush=True)
        if "ten" in cases:
            run["ten"] = []
            for store, hot in (("files", False), ("chunks", False), ("chunks", True)):
                print(f"== ten: {store}{' with hot copies' if hot else ''}", flush=True)
                with tempfile.TemporaryDirectory(prefix="kvproxy-bench-hot-",
                                                 dir=memory_folder()) as memory:
                    run["ten"].append(case_ten(work / f"ten-{store}-{hot}", store, 256,
                                               *ten_prompts, Path(memory) if hot else None))
                print(json.dumps({k: v for k, v in run["ten"][-1].items()}), flush=True)
        if "gap" in cases:
            run["gap"] = []
            for store, folder in (("files", "disk"), ("chunks", "disk"), ("chunks", "tmpfs")):
                print(f"== gap: {store} on {folder}", flush=True)
                memory = memory_folder() if folder == "tmpfs" else tmp
                with tempfile.TemporaryDirectory(prefix="kvproxy-bench-gap-", dir=memory) as at:
                    run["gap"].append(case_gap(Path(at), store, 256, *ten_prompts,
                                               args.answer_tokens, folder))
                print(json.dumps(run["gap"][-1]), flush=True)
    run["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = report(run)
    write_figures(Path(args.out), run, text)
    print(text)
    if not args.no_page:
        put_on_page(text, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
