"""The concurrency scenario: several users at once, each with its own long system prompt.

For each group size (4 users, then 8, by default) every mode gets a fresh
llama-server (and kvproxy) on the same build and model:

  (a) llama-server ``-np N`` straight, its own slot selection and RAM cache (llama-server's
      defaults: ``--slot-prompt-similarity 0.1``, ``--cache-ram 8192``): what a user would run;
  (b) kvproxy in front of a one-slot llama-server;
  (c) kvproxy managing N slots (``KVPROXY_SLOTS=N``; llama-server ``-np N
      --slot-prompt-similarity 0``).

Every slot gets the same context (``-c`` is ``slots x slot_ctx``, llama-server splits it).
All users start together; each streams several turns with short think times between them.
Afterwards every prompt is tokenized as llama-server would, to count the minimum prompt
tokens and to check that no conversation ran in another's cache (bench/concurrency_stats.py).
"""
from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from pathlib import Path

import requests

from kvproxy.launch.serve import llama_layout

from . import batched, micro, slot_overhead
from . import concurrency_stats as stats
from .client import stream_chat, templated_tokens, tokenize
from .procs import Mode, cpu_used
from .readings import scrape_metrics, sidecars
from .workload import WORDS, text_of_tokens

# llama-server's own defaults, written out so the last flag wins over anything before it.
LLAMA_DEFAULT_CACHE_RAM_MIB = 8192
LLAMA_DEFAULT_SIMILARITY = "0.1"
PER_TURN_ALLOWANCE = 60   # question, template and a little slack, tokens, besides the reply
# A 70B-class model's KV cache per token (Llama 3 70B: 80 layers, 8 KV heads of 128, f16 K and V).
SEVENTY_B_KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2


@dataclasses.dataclass
class User:
    name: str
    system: str
    system_tokens: int
    questions: list[str]
    think_s: list[float]     # pause after each turn


def system_sizes(users: int, low: int, high: int) -> list[int]:
    """Evenly spread system prompt sizes from ``low`` to ``high`` tokens."""
    if users == 1:
        return [high]
    return [round(low + (high - low) * i / (users - 1)) for i in range(users)]


def build_users(http: requests.Session, llama_url: str, users: int, low: int, high: int,
                turns: int, think: tuple[float, float], seed: int = 5000) -> list[User]:
    """Users U1..Un, each with a system prompt of its own (own seed, own size)."""
    out = []
    for i, size in enumerate(system_sizes(users, low, high)):
        text, n = text_of_tokens(http, llama_url, size, seed + i)
        rng = random.Random(seed * 3 + i)
        name = f"U{i + 1}"
        questions = [f"Question {t + 1} from {name}: in one short sentence, what does rule "
                     f"{rng.randint(1, 40)} say about the {rng.choice(WORDS)}?" for t in range(turns)]
        pauses = [round(rng.uniform(*think), 3) for _ in range(turns)]
        out.append(User(name, text, n, questions, pauses))
    return out


def fits(system_high: int, turns: int, max_tokens: int, slot_ctx: int) -> bool:
    """Whether the longest conversation fits one slot's context."""
    return system_high + turns * (max_tokens + PER_TURN_ALLOWANCE) <= slot_ctx


def kv_bytes_per_token(metadata: dict, bytes_per_value: int = 2) -> int | None:
    """K and V bytes per token of a model from its GGUF header (llama-server's default f16
    cache): 2 x layers x KV heads x head size x bytes per value; None when the header lacks
    them."""
    arch = metadata.get("general.architecture")
    get = lambda key: metadata.get(f"{arch}.{key}")  # noqa: E731
    layers, kv_heads = get("block_count"), get("attention.head_count_kv") or \
        get("attention.head_count")
    heads, width = get("attention.head_count"), get("embedding_length")
    key_size = get("attention.key_length") or (width // heads if width and heads else None)
    value_size = get("attention.value_length") or key_size
    if isinstance(kv_heads, list):   # per-layer head counts: the largest bounds the cache
        kv_heads = max(kv_heads)
    if not (isinstance(layers, int) and isinstance(kv_heads, int) and key_size and value_size):
        return None
    return layers * kv_heads * (key_size + value_size) * bytes_per_value


def scaled_cache_ram(metadata: dict, gib: float,
                     reference: int = SEVENTY_B_KV_BYTES_PER_TOKEN) -> dict | None:
    """The ``--cache-ram`` (MiB) at which this model's RAM cache holds as many tokens as
    ``gib`` GiB hold for a model of ``reference`` KV bytes per token."""
    per_token = kv_bytes_per_token(metadata)
    if not per_token:
        return None
    tokens = gib * 1024 ** 3 / reference
    return {"gib": gib, "reference_bytes_per_token": reference,
            "model_bytes_per_token": per_token, "tokens": int(tokens),
            "mib": max(1, round(tokens * per_token / 1024 ** 2))}


def llama_options(direct: bool, slots: int, slot_ctx: int, proxy_cache_ram: int | None = None,
                  cache_ram_cap: int | None = None) -> dict:
    """LlamaServer keyword arguments for a mode.

    Straight llama-server keeps its own defaults for slot choice and RAM cache. Behind
    kvproxy, llama-server is started the way kvproxy starts it, ``LlamaServer(slots=N)``,
    with the ``--cache-ram`` that ``make run`` picks for that many slots (off with several,
    kvproxy.launch.serve.llama_layout). ``proxy_cache_ram`` (MiB) replaces it.
    ``cache_ram_cap`` (MiB, the scaled-RAM scenario) bounds every mode's RAM cache.
    """
    options: dict = {"ctx_size": slots * slot_ctx}
    if direct:
        options["cache_ram_mib"] = LLAMA_DEFAULT_CACHE_RAM_MIB
        options["extra_args"] = ["-np", str(slots), "--slot-prompt-similarity",
                                 LLAMA_DEFAULT_SIMILARITY]
    else:
        options["cache_ram_mib"] = llama_layout({"LLAMA_SLOTS": str(slots)})[2] \
            if proxy_cache_ram is None else proxy_cache_ram
        options["slots"] = slots
    if cache_ram_cap is not None:
        options["cache_ram_mib"] = min(options["cache_ram_mib"], cache_ram_cap)
    return options


def mode_plan(slots: int) -> dict[str, tuple[str, bool, int]]:
    """key -> (label, through kvproxy, llama-server slots)."""
    return {
        "a": (f"(a) llama-server -np {slots}", False, slots),
        "b": ("(b) kvproxy, 1 slot", True, 1),
        "c": (f"(c) kvproxy, {slots} slots", True, slots),
    }


def make_mode(key: str, slots: int, slot_ctx: int, workdir: Path,
              proxy_cache_ram: int | None = None, cache_ram_cap: int | None = None) -> Mode:
    label, proxied, n = mode_plan(slots)[key]
    return Mode(key, label, workdir, None, proxied,
                llama_options=llama_options(not proxied, n, slot_ctx,
                                            proxy_cache_ram=proxy_cache_ram,
                                            cache_ram_cap=cache_ram_cap),
                # Straight llama-server queues a request without a bound: so may kvproxy
                # here (a 503 would end that user's conversation).
                proxy_env={"KVPROXY_SLOTS": str(n), "KVPROXY_LOCK_TIMEOUT": "3600"}
                if proxied else None)


class Recorder:
    """Collects finished turns from the user threads."""

    def __init__(self, log, tag: str):
        self.turns: list[dict] = []
        self.messages: list[list[dict]] = []
        self.replies: list[str] = []
        self._lock = threading.Lock()
        self.log = log
        self.tag = tag

    def add(self, turn: dict, messages: list[dict], reply: str) -> None:
        with self._lock:
            self.turns.append(turn)
            self.messages.append(messages)
            self.replies.append(reply)
        self.log(f"  [{self.tag}] {turn['conversation']} turn {turn['round'] + 1}: ttft "
                 f"{_fmt(turn['ttft_s'])} computed {turn['prompt_n']} reused {turn['cache_n']}"
                 + (f" cache={turn['cache_header']}" if turn["cache_header"] else "")
                 + (f" ERROR {turn['status']} {turn['error']}" if turn["error"] else ""))


def user_loop(user: User, url: str, turns: int, max_tokens: int, read_timeout: float,
              start: threading.Barrier, t0: list[float], recorder: Recorder,
              stop: threading.Event) -> None:
    """One user: a turn, a pause, the next turn; stops at the first failed turn."""
    history = [{"role": "system", "content": user.system}]
    with requests.Session() as http:
        start.wait(timeout=60)
        for round_no in range(turns):
            if stop.is_set():
                return
            messages = history + [{"role": "user", "content": user.questions[round_no]}]
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 42}
            sent = time.perf_counter()
            try:
                answer = stream_chat(http, url, body, read_timeout=read_timeout)
                status, error, reply = answer.status, answer.error, answer.content
                timings, headers, ttft = answer.timings, answer.headers, answer.first_token
            except (requests.RequestException, TimeoutError, ValueError) as exc:
                status, error, reply, timings, headers, ttft = 0, repr(exc)[:300], "", {}, {}, None
            finished = time.perf_counter()
            turn = {"conversation": user.name, "round": round_no,
                    "sent_s": round(sent - t0[0], 4), "finished_s": round(finished - t0[0], 4),
                    "ttft_s": ttft, "total_s": round(finished - sent, 4),
                    "prompt_n": int(timings.get("prompt_n") or 0),
                    "cache_n": int(timings.get("cache_n") or 0),
                    "predicted_n": int(timings.get("predicted_n") or 0),
                    "status": status, "error": error,
                    "cache_header": headers.get("X-KVProxy-Cache"),
                    "session_header": headers.get("X-KVProxy-Session"),
                    "reply_chars": len(reply)}
            recorder.add(turn, messages, reply)
            if status != 200 or error:
                return
            history = messages + [{"role": "assistant", "content": reply}]
            if round_no + 1 < turns:
                stop.wait(user.think_s[round_no])


def run_users(url: str, users: list[User], turns: int, max_tokens: int, read_timeout: float,
              recorder: Recorder, budget_s: float) -> float:
    """Every user in its own thread, all released at once; returns the wall time."""
    start = threading.Barrier(len(users) + 1)
    stop = threading.Event()
    t0 = [0.0]
    threads = [threading.Thread(target=user_loop, name=f"bench-{u.name}", daemon=True,
                                args=(u, url, turns, max_tokens, read_timeout, start, t0,
                                      recorder, stop)) for u in users]
    for thread in threads:
        thread.start()
    t0[0] = time.perf_counter()
    start.wait(timeout=60)
    deadline = time.monotonic() + budget_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        stop.set()
        recorder.log(f"  [{recorder.tag}] time budget of {budget_s:.0f} s used up; stopping users")
        for thread in threads:
            thread.join(read_timeout + 30)
    return max((t["finished_s"] for t in recorder.turns), default=0.0)


def account(recorder: Recorder, users: list[User], llama_url: str) -> None:
    """Tokenize every prompt and reply as llama-server does (for the minimum and cross-talk)."""
    systems = {u.name: u.system for u in users}
    bases: dict[str, list[int]] = {}
    with requests.Session() as http:
        for name, system in systems.items():
            bases[name] = templated_tokens(http, llama_url, [{"role": "system", "content": system}])
        for turn, messages, reply in zip(recorder.turns, recorder.messages, recorder.replies):
            tokens = templated_tokens(http, llama_url, messages)
            turn["tokens"] = tokens
            turn["own_base"] = bases[turn["conversation"]]
            turn["prompt_tokens"] = len(tokens)
            if turn["status"] == 200 and not turn["error"]:
                turn["history"] = tokens + tokenize(http, llama_url, reply, special=False)


def base_snapshot_tokens(slot_dir: Path) -> int:
    """Prompt tokens kvproxy computed for system-prompt snapshots, outside request timings."""
    return sum(int(s.get("prefill_computed") or 0) for s in sidecars(slot_dir)
               if s.get("kind") == "base")


def run_mode(mode: Mode, users: list[User], settings: dict, log) -> dict:
    """One mode with one group of users on a started stack; the mode's figures and turns."""
    tag = f"{mode.key}/{len(users)}u"
    recorder = Recorder(log, tag)
    cpu_before = mode.cpu()
    wall = run_users(mode.url, users, settings["turns"], settings["max_tokens"],
                     settings["read_timeout"], recorder, settings["budget_s"])
    cpu = cpu_used(cpu_before, mode.cpu())
    turns = sorted(recorder.turns, key=lambda t: (t["sent_s"], t["conversation"]))
    order = {id(t): i for i, t in enumerate(recorder.turns)}
    recorder.turns = turns
    recorder.messages = [recorder.messages[order[id(t)]] for t in turns]
    recorder.replies = [recorder.replies[order[id(t)]] for t in turns]
    account(recorder, users, mode.llama_url)
    for turn, minimum in zip(turns, stats.minimum_new_tokens(turns)):
        turn["min_new_tokens"] = minimum
    findings = stats.crosstalk(turns, proxied=mode.proxy is not None)
    for turn in turns:
        turn["reuse_limit"] = stats.reuse_limit(turn, turns)
    extra = base_snapshot_tokens(mode.slot_dir) if mode.proxy else 0
    summary = stats.summarize(turns, wall, sum(t["min_new_tokens"] for t in turns), extra, findings)
    summary["cpu"] = cpu
    log(f"  [{tag}] wall {wall:.1f} s, ttft p50/p95 after the first turn "
        f"{_fmt(summary['ttft_later_p50_s'])}/{_fmt(summary['ttft_later_p95_s'])}, "
        f"{summary['generated_per_s'] or 0:.1f} generated tokens/s, computed "
        f"{summary['computed_tokens']} (minimum {summary['minimum_tokens']}), cross-talk: "
        f"{stats.crosstalk_text(summary)}; CPU s: {cpu}")
    for finding in findings[:20]:
        log(f"  [{tag}] cross-talk {finding['conversation']} turn {finding['round'] + 1}: "
            f"{finding['kind']}: {finding['detail']}")
    for turn in turns:  # token lists are for the checks only, not for the JSON
        for key in ("tokens", "history", "own_base"):
            turn.pop(key, None)
    return {"summary": summary, "findings": findings, "turns": turns}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def recorded_overhead(results_dir: Path) -> dict | None:
    """The no-swap overhead of the last full main benchmark, for comparison."""
    try:
        run = json.loads((results_dir / "latest.json").read_text())
        ov = run["sections"]["overhead"]
        return {"started_at": run.get("started_at"),
                **{k: ov[k] for k in ("direct_median_ms", "proxy_median_ms", "added_median_ms",
                                      "added_p99_ms")}}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_scenario(settings: dict, work: Path, log, record: dict) -> None:
    """Every group of users against every mode; fills ``record`` as it goes, so an
    interruption keeps what was measured. A mode that fails is recorded and skipped."""
    slots, skip = settings["slots"], settings["skip"]
    plan = mode_plan(slots)
    record.update(groups=[], overhead={}, mode_labels={k: plan[k][0] for k in settings["modes"]},
                  mode_commands={}, n_ctx=f"{settings['slot_ctx']} per slot")
    if "batched" not in skip:
        record["batched"] = batched.measure(*settings["batched"], log=log)
    if "overhead" not in skip and slots > 1:
        log(f"== no-swap request path: kvproxy driving 1 and {slots} slots, same layout")
        folder = work / "slot-path"
        folder.mkdir(parents=True, exist_ok=True)
        record["slot_path"] = slot_overhead.summary(slot_overhead.measure(
            slots, settings["slot_ctx"], settings["overhead_requests"] * 2, folder), slots)
        log(f"  median {record['slot_path']['one_slot_median_ms']:.2f} ms driving 1, "
            f"{record['slot_path']['all_slots_median_ms']:.2f} ms driving {slots}")
    cap = None
    if settings.get("cache_ram_like_gib"):
        from kvproxy.launch.processes import bundled_model
        from kvproxy.upstream import gguf
        record["scaled_cache_ram"] = scaled_cache_ram(gguf.file_facts(bundled_model())[0],
                                                      settings["cache_ram_like_gib"])
        if record["scaled_cache_ram"] is None:
            raise ValueError("the bundled model's GGUF header does not give its KV size")
        cap = record["scaled_cache_ram"]["mib"]
        log(f"scaled RAM cache: {cap} MiB holds {record['scaled_cache_ram']['tokens']} tokens "
            f"of this model, as {settings['cache_ram_like_gib']} GiB would of a 70B-class model")
    for users in settings["users"]:
        group: dict = {"users": users, "modes": {}, "summaries": {}, "results": {}}
        record["groups"].append(group)
        people: list[User] | None = None
        for key in settings["modes"]:
            mode = make_mode(key, slots, settings["slot_ctx"], work / f"{users}u-{key}",
                             settings.get("proxy_cache_ram"), cap)
            log(f"\n== {users} users, {mode.label}")
            try:
                start_s = mode.start()
                if "build_info" not in record:
                    props = requests.get(mode.llama_url + "/props", timeout=10).json()
                    record["build_info"] = props.get("build_info")
                    record["model"] = Path(props.get("model_path") or "").name
                if people is None:
                    with requests.Session() as http:
                        people = build_users(http, mode.llama_url, users,
                                             *settings["system_tokens"], settings["turns"],
                                             tuple(settings["think"]))
                    group["conversations"] = [{"name": u.name, "system_tokens": u.system_tokens}
                                              for u in people]
                    log("users: " + ", ".join(f"{u.name} ({u.system_tokens} tokens)" for u in people))
                record["mode_commands"].setdefault(key, shown_command(mode.llama.command()[1:])
                                                   + (f" + kvproxy, KVPROXY_SLOTS={plan[key][2]}"
                                                      if mode.proxy else ""))
                result = run_mode(mode, people, settings, log)
                if mode.proxy:
                    result["metrics_after"] = scrape_metrics(mode.proxy.url)
                    if users == settings["users"][0] and "overhead" not in skip:
                        log(f"== proxy overhead without a swap, {mode.label}")
                        record["overhead"][key] = micro.overhead(
                            mode.proxy.url, mode.llama_url, settings["overhead_requests"], log)
                group["modes"][key] = {"label": mode.label, "proxied": mode.proxy is not None,
                                       "start_seconds": round(start_s, 2)}
                group["results"][key] = result
                group["summaries"][key] = result["summary"]
            except (OSError, RuntimeError, ValueError, requests.RequestException) as exc:
                log(f"  [{key}/{users}u] failed: {exc!r}; see {mode.workdir} with --keep")
                group.setdefault("failed", {})[key] = repr(exc)[:500]
            finally:
                mode.stop()


def shown_command(args: list[str]) -> str:
    """llama-server's flags as they take effect (the last of a repeated flag wins), without
    this machine's paths and ports."""
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        flag, value = args[i], None
        if i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
            i += 1
        i += 1
        flags.pop(flag, None)
        flags[flag] = value
    for private in ("-m", "--host", "--port", "--slot-save-path"):
        flags.pop(private, None)
    return " ".join(["llama-server"] + [f if v is None else f"{f} {v}" for f, v in flags.items()])
