"""The shared session store, timed: ``make bench-store``.

One real SeaweedFS (``weed mini``) and two nodes, each the bundled model's llama-server plus
kvproxy under gunicorn with ``KVPROXY_STORE_URL`` on one bucket. A ~6,000-token conversation
(a ~5,600-token system prompt and a first message) is answered and saved on node A; then its
next turn is taken three ways in the same run:

- ``store``: on node B, whose slot folder is empty: fetched from the bucket and restored
  (the fetch's own time from the ``X-KVProxy-Fetched`` header, and the whole turn);
- ``local``: on node A after its llama-server restarted (the slot empty): restored from A's
  slot folder;
- ``cold``: the same prompt straight to A's llama-server with ``cache_prompt: false``.

Each round is a conversation of its own (its own system prompt) with its own fresh node B;
the node's next turns answer one token, so the machine's other work weighs least on them.
Also read: how long after the first turn's answer its session object is in the bucket (HEAD,
polled), and node A's upload figures from ``/metrics`` over the first turn (bytes and seconds
of its uploads: the base snapshot kvproxy takes of the system prompt during the turn, then the
session).
Figures go to ``bench/results/store.json`` and ``store.md`` and to docs/benchmark.md between
its ``bench-store`` markers.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import botocore.exceptions
import requests

from bench.procs import Mode
from bench.readings import cores_and_load, sidecar_files
from bench.client import session_turn
from bench.report import RESULTS, put_on_page, write_figures
from bench.workload import text_of_tokens
from kvproxy.launch.seaweed import MISSING, WeedMini, weed_binary
from kvproxy.storage.shared.location import NO_USER, StoreLocation

START, END = "<!-- bench-store:start -->", "<!-- bench-store:end -->"
READ_TIMEOUT = 600
IN_STORE_TIMEOUT = 120.0
SETTLE_DELAY = "0.5"       # KVPROXY_SAVE_BEHIND_DELAY: the save starts soon after the answer
CTX = 8192
FIRST_ANSWER_TOKENS = 16
FETCHED = re.compile(r"^store; ms=(?P<ms>[\d.]+)")
UPLOADS = "kvproxy_store_upload_seconds_count"
STORE_FAMILIES = ("kvproxy_store_upload_bytes_total", "kvproxy_store_upload_seconds",
                  "kvproxy_store_upload_queue",
                  "kvproxy_store_uploads_total", "kvproxy_store_fetch_bytes_total",
                  "kvproxy_store_fetch_seconds")


# -- readings (pure) ------------------------------------------------------------------------
def fetched_ms(header: str | None) -> float | None:
    """The fetch time ``X-KVProxy-Fetched: store; ms=<ms>`` names; None without one."""
    match = FETCHED.match(header or "")
    return float(match["ms"]) if match else None


def store_metrics(text: str) -> dict[str, float]:
    """The shared store's samples of a /metrics page, summed over labels except ``outcome``
    and ``kind`` (kept as ``name{label=value}``)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in STORE_FAMILIES and family.name + "_total" not in STORE_FAMILIES:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                             if k in ("outcome", "kind"))
            key = sample.name + (f"{{{label}}}" if label else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def upload_figures(metrics: dict[str, float]) -> dict:
    """Bytes uploaded (chunks and session objects), seconds spent uploading, and the rate."""
    sent = sum(v for k, v in metrics.items() if k.startswith("kvproxy_store_upload_bytes_total"))
    seconds = metrics.get("kvproxy_store_upload_seconds_sum", 0.0)
    return {"bytes": int(sent), "seconds": round(seconds, 3),
            "uploads": int(metrics.get("kvproxy_store_upload_seconds_count", 0)),
            "mb_per_s": round(sent / seconds / 1e6, 1) if seconds > 0 else None}


# -- the nodes ------------------------------------------------------------------------------
def node(work: Path, name: str, store_env: dict[str, str]) -> Mode:
    """llama-server plus kvproxy with the shared store on, a slot folder of its own."""
    env = {**store_env, "KVPROXY_SAVE_BEHIND_DELAY": SETTLE_DELAY, "KVPROXY_NODE_NAME": name}
    return Mode(name, name, work / name, None, True,
                llama_options={"ctx_size": CTX, "cache_ram_mib": 0}, proxy_env=env)


def chat(url: str, session: str, messages: list[dict], max_tokens: int) -> dict:
    """One turn (temperature 0) through kvproxy: its time, tokens and kvproxy's headers."""
    turn = session_turn(url, session, messages, max_tokens, READ_TIMEOUT)
    return {**turn, "seconds": round(turn["seconds"], 3), "answered_at": time.monotonic(),
            "fetch_ms": fetched_ms(turn["fetched"])}


def cold(llama_url: str, messages: list[dict], max_tokens: int) -> dict:
    """The same turn straight to llama-server, its prompt cache unused: a full prefill."""
    started = time.perf_counter()
    response = requests.post(llama_url + "/v1/chat/completions",
                             json={"messages": messages, "temperature": 0, "max_tokens": max_tokens,
                                   "cache_prompt": False}, timeout=(5, READ_TIMEOUT))
    seconds = time.perf_counter() - started
    response.raise_for_status()
    body = response.json()
    timings = body.get("timings") or {}
    return {"seconds": round(seconds, 3), "prompt_tokens": timings.get("prompt_n"),
            "prompt_ms": timings.get("prompt_ms"), "reused_tokens": timings.get("cache_n", 0)}


def stored_stem(slot_dir: Path, session: str) -> str | None:
    for _path, data in sidecar_files(slot_dir):
        if data.get("kind") == "session" and data.get("session_id") == session:
            return data.get("stem")
    return None


def until_in_store(weed: WeedMini, location: StoreLocation, slot_dir: Path, session: str,
                   answered_at: float) -> float:
    """Seconds from the answer until the session object is in the bucket (HEAD answers)."""
    s3 = weed.client()
    deadline = answered_at + IN_STORE_TIMEOUT
    while time.monotonic() < deadline:
        stem = stored_stem(slot_dir, session)
        if stem:
            try:
                s3.head_object(Bucket=location.bucket, Key=location.session(NO_USER, stem))
                return round(time.monotonic() - answered_at, 3)
            except botocore.exceptions.ClientError:
                pass
        time.sleep(0.05)
    raise TimeoutError(f"{session}: not in the bucket {IN_STORE_TIMEOUT:.0f} s after its answer")


def wait_uploads(url: str, count: float, timeout: float = IN_STORE_TIMEOUT) -> None:
    """Until the node has finished ``count`` uploads (its queue empty)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = metrics_of(url)
        if now.get(UPLOADS, 0.0) >= count and not now.get("kvproxy_store_upload_queue"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url}: {count:.0f} uploads not done within {timeout:.0f} s")


def metrics_of(url: str) -> dict[str, float]:
    return store_metrics(requests.get(url + "/metrics", timeout=10).text)


# -- the run --------------------------------------------------------------------------------
def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def one_round(weed: WeedMini, location: StoreLocation, store_env: dict[str, str], a: Mode,
              work: Path, index: int, sizes: tuple[int, int], answer_tokens: int) -> dict:
    """A conversation of its own (its own system prompt): first turn on A, then its next turn
    from the store on a fresh node B, from A's disk after a restart, and computed cold."""
    with requests.Session() as http:
        system, n_system = text_of_tokens(http, a.llama_url, sizes[0], 3800 + 2 * index)
        first, n_first = text_of_tokens(http, a.llama_url, sizes[1], 3801 + 2 * index)
    session = f"store-bench-{index}"
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": first + "\nSum it up in one line."}]
    print(f"== round {index}: first turn on node A", flush=True)
    before = metrics_of(a.url)
    turn1 = chat(a.url, session, messages, FIRST_ANSWER_TOKENS)
    in_store = until_in_store(weed, location, a.slot_dir, session, turn1["answered_at"])
    time.sleep(1.0)          # the upload's metrics are counted just after the last PUT
    upload = upload_figures(delta(metrics_of(a.url), before))
    nxt = messages + [{"role": "assistant", "content": turn1["reply"]},
                      {"role": "user", "content": "And the rule that matters most?"}]
    print(f"== round {index}: next turn on a fresh node B, from the store", flush=True)
    b = node(work, f"node-b{index}", store_env)
    try:
        b.start()
        from_store = chat(b.url, session, nxt, answer_tokens)
        fetch = metrics_of(b.url)
    finally:
        b.stop()
    print(f"== round {index}: next turn on node A after a restart, from its disk", flush=True)
    a.restart()
    uploaded = metrics_of(a.url).get(UPLOADS, 0.0)
    local = chat(a.url, session, nxt, answer_tokens)
    # its save goes up before llama-server is taken for the cold prefill, and before the
    # next round counts its own uploads
    wait_uploads(a.url, uploaded + 1)
    print(f"== round {index}: the same turn straight to llama-server, cache_prompt false",
          flush=True)
    computed = cold(a.llama_url, nxt, answer_tokens)
    drop = ("answered_at", "reply")
    return {"system_tokens": n_system, "first_tokens": n_first,
            "first": {k: v for k, v in turn1.items() if k not in drop},
            "in_store_s": in_store, "upload": upload,
            "fetch_bytes": int(fetch.get("kvproxy_store_fetch_bytes_total", 0)),
            "fetch_seconds": round(fetch.get("kvproxy_store_fetch_seconds_sum", 0.0), 3),
            "store": {k: v for k, v in from_store.items() if k not in drop},
            "local": {k: v for k, v in local.items() if k not in drop},
            "cold": computed}


def measure(work: Path, rounds: int, sizes: tuple[int, int], answer_tokens: int) -> list[dict]:
    """Every round on one SeaweedFS, one bucket and one node A; each round its own node B."""
    weed = WeedMini(work / "weed", work / "weed.log").start()
    try:
        location = StoreLocation.parse(f"s3://{weed.new_bucket()}/bench")
        store_env = {**weed.env(), "KVPROXY_STORE_URL": location.url}
        a = node(work, "node-a", store_env)
        try:
            a.start()
            out = []
            for index in range(rounds):
                out.append(one_round(weed, location, store_env, a, work, index, sizes,
                                     answer_tokens))
                print(json.dumps(out[-1]), flush=True)
            return out
        finally:
            a.stop()
    finally:
        weed.stop()


# -- report ---------------------------------------------------------------------------------
def _share(turn: dict) -> float:
    total = turn.get("prompt_tokens") or 0
    return (turn.get("reused_tokens") or 0) / total if total else 0.0


def _seconds(values: list[float]) -> str:
    """The median, and every round's value when there are several."""
    text = f"{statistics.median(values):.2f} s"
    return text + (f" ({', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else "")


def report(run: dict) -> str:
    rounds = run["rounds"]
    load = run["load"]
    first = rounds[0]
    store = [r["store"] for r in rounds]
    local = [r["local"] for r in rounds]
    computed = [r["cold"] for r in rounds]
    fetch_ms = [t["fetch_ms"] for t in store if t["fetch_ms"] is not None]
    caches = lambda turns: "/".join(sorted({t["cache"] or "-" for t in turns}))  # noqa: E731
    t_store = statistics.median(t["seconds"] for t in store)
    t_local = statistics.median(t["seconds"] for t in local)
    t_cold = statistics.median(t["seconds"] for t in computed)
    fetched = [r["fetch_bytes"] / r["fetch_seconds"] / 1e6 for r in rounds if r["fetch_seconds"]]
    uploads = [r["upload"] for r in rounds]
    rates = [u["mb_per_s"] for u in uploads if u["mb_per_s"]]
    lines = [
        START, "## Resuming from the shared store (`make bench-store`)", "",
        f"Run {run['started']}, {load['before'].get('cores')} cores "
        f"({load['before'].get('cpu')}), load average "
        f"{' '.join(map(str, load['before']['loadavg']))} at start, "
        f"{' '.join(map(str, load['after']['loadavg']))} at end (other work on the machine "
        f"makes timings noisy); bundled model (SmolLM2-135M), `weed mini` {run['weed']} on "
        f"loopback, nodes of llama-server and kvproxy under gunicorn on one bucket; "
        f"{len(rounds)} round(s), each a conversation of its own.", "",
        f"Each conversation, a {first['system_tokens']:,}-token system prompt and a "
        f"{first['first_tokens']:,}-token first message ({first['first']['prompt_tokens']:,} "
        f"prompt tokens), is answered on node A; its next turn "
        f"({local[0]['prompt_tokens']:,} prompt tokens, an answer of {run['answer_tokens']} "
        f"token(s)) is then taken three ways:", "",
        "| next turn | cache | prompt reused (lowest) | whole turn, median (each round) | "
        "of which fetching, median |",
        "|---|---|---:|---:|---:|",
        f"| a fresh node B, empty slot folder: from the store | {caches(store)} | "
        f"{min(map(_share, store)):.1%} | {_seconds([t['seconds'] for t in store])} | "
        f"{f'{statistics.median(fetch_ms):.0f} ms' if fetch_ms else '-'} |",
        f"| node A after a llama-server restart: its own disk | {caches(local)} | "
        f"{min(map(_share, local)):.1%} | {_seconds([t['seconds'] for t in local])} | - |",
        f"| cold prefill (llama-server, `cache_prompt: false`) | - | "
        f"{min(map(_share, computed)):.1%} | {_seconds([t['seconds'] for t in computed])} | - |",
        "",
        f"From the store against a cold prefill: {t_cold / t_store:.1f}x faster; against the "
        f"local disk: {t_store / t_local:.2f}x its time. Node B fetched "
        f"{statistics.median(r['fetch_bytes'] for r in rounds) / 1e6:,.1f} MB per round"
        + (f", {statistics.median(fetched):,.0f} MB/s (median)." if fetched else "."),
        "",
        f"**Upload** (node A's `kvproxy_store_upload_*` on `/metrics` over each first turn's "
        f"upload): {statistics.median(u['bytes'] for u in uploads) / 1e6:,.1f} MB of chunks and "
        f"session objects per conversation ({uploads[0]['uploads']} uploads: the base snapshot "
        f"kvproxy takes of the system prompt during the first turn, then the session) in "
        f"{_seconds([u['seconds'] for u in uploads])} of uploading"
        + (f", {statistics.median(rates):,.1f} MB/s (median)" if rates else "") + ". "
        f"**In the store** {_seconds([r['in_store_s'] for r in rounds])} after the first "
        f"turn's answer (HEAD on its session object, polled every 50 ms; the save starts "
        f"{SETTLE_DELAY} s after the answer, `KVPROXY_SAVE_BEHIND_DELAY`).",
        "", END]
    return "\n".join(lines)


def weed_version() -> str:
    binary = weed_binary()
    out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"version \S+ ([\d.]+)", out)
    return match[1] if match else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system-tokens", type=int, default=5600)
    parser.add_argument("--first-tokens", type=int, default=400)
    parser.add_argument("--answer-tokens", type=int, default=1,
                        help="answer tokens of the measured turns (1: the time to the answer's "
                             "first token, least touched by the machine's other work)")
    parser.add_argument("--rounds", type=int, default=2, help="conversations, each timed")
    parser.add_argument("--out", default=str(RESULTS / "store"),
                        help="where the figures go (.json and .md are added)")
    parser.add_argument("--no-page", action="store_true", help="leave docs/benchmark.md alone")
    parser.add_argument("--from-json", help="render saved figures again (the .md beside them "
                                            "and the page), start nothing")
    parser.add_argument("--keep", help="a folder to run in and keep (logs, slot folders); "
                                       "default: a temporary one, deleted")
    args = parser.parse_args(argv)
    if args.from_json:
        run = json.loads(Path(args.from_json).read_text())
        Path(args.from_json).with_suffix(".md").write_text(report(run) + "\n")
    else:
        if weed_binary() is None:
            print(MISSING, file=sys.stderr)
            return 2
        run = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "weed": weed_version(), "answer_tokens": args.answer_tokens,
               "load": {"before": cores_and_load()}}
        with tempfile.TemporaryDirectory(prefix="kvproxy-bench-store-") as tmp:
            work = Path(args.keep) if args.keep else Path(tmp)
            run["rounds"] = measure(work, args.rounds, (args.system_tokens, args.first_tokens),
                                    args.answer_tokens)
        run["load"]["after"] = cores_and_load()
        write_figures(Path(args.out), run, report(run))
    text = report(run)
    print(text)
    if not args.no_page:
        put_on_page(text, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
