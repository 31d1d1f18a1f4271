"""Load and soak test against the real llama-server: ``python -m bench.soak`` (``make soak``).

Many concurrent clients over a few sessions, on all three APIs, streamed and whole, some
leaving mid-stream, some with hostile session ids, spread over TWO kvproxy processes that
share one slot folder and one llama-server (started with ``--cache-ram 0``, so any reuse
comes from kvproxy's own slot files). Afterwards it checks that

- every answer ran in its own session: the reply's ``X-KVProxy-Session`` is the session's
  id, and the reused and computed token counts fit the cache state (each session has its
  own system prompt, so an answer computed on another session's state would reuse almost
  nothing, and a warm answer computes less than the system prompt: only its new turn);
- nothing deadlocked (every client finished in time), the slot is free, and the kvproxy
  workers did not grow threads or file descriptors;
- every slot file on disk has a sidecar whose byte count matches it,

and prints the figures: requests, errors by kind, p50/p99 latency.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.procs import Proxy
from bench.readings import files_match_sidecars
from kvproxy.storage.usage import folder_usage
from bench.workload import long_text
from kvproxy.sessions.identity import normalise_id
from kvproxy.launch.processes import LlamaServer
from kvproxy.slots.lease import header_safe
from kvproxy.web.common import AFTER_REPLY_THREADS

APIS = ("openai", "anthropic", "ollama")
OLLAMA_MODEL = ["?"]  # the served name, read from /api/tags at start
POOL_THREADS = 16
# kvproxy's own long-lived threads besides the pool, each started on first use: the
# save-behind saver, the one that asks llama-server's fingerprint beside a swap, the one
# that watches whole answers' clients, the one that writes held sidecar notes, the one
# that frees lingering slot file locks, the one that lists the slot folder for the trail
# index (for a moment, once a second), and up to AFTER_REPLY_THREADS that run a reply's
# closers.
BACKGROUND_THREADS = 6 + AFTER_REPLY_THREADS
# A miss may still share the chat template's first tokens with what the slot held.
MISS_REUSE_MAX = 16


@dataclass
class Config:
    clients: int = 32
    sessions: int = 8
    seconds: float = 300.0
    max_tokens: int = 4
    disconnect_share: float = 0.1
    stream_share: float = 0.5
    read_share: float = 0.4  # turns that ask about the history without adding to it
    system_words: int = 60
    seed: int = 1


class TurnLock:
    """Readers share, a writer is alone; a waiting writer holds new readers back. Bounded."""

    def __init__(self, timeout: float = 600.0):
        self._changed = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._timeout = timeout

    def _wait(self, ready) -> None:
        if not self._changed.wait_for(ready, timeout=self._timeout):
            raise RuntimeError("a session stayed locked: a client hung")

    def take(self, write: bool) -> None:
        with self._changed:
            if write:
                self._writers_waiting += 1
                try:
                    self._wait(lambda: not self._writing and self._readers == 0)
                finally:
                    self._writers_waiting -= 1
                self._writing = True
            else:
                self._wait(lambda: not self._writing and self._writers_waiting == 0)
                self._readers += 1

    def give(self, write: bool) -> None:
        with self._changed:
            if write:
                self._writing = False
            else:
                self._readers -= 1
            self._changed.notify_all()


@dataclass
class Session:
    """One conversation: its API, how it names itself, its history."""

    number: int
    api: str
    raw_id: str
    id_field: str
    system: str
    system_tokens: int = 0
    history: list[dict] = field(default_factory=list)
    # Writes take the session alone, reads share it. A read that carried an older history
    # and ran after newer writes would rewind the session's saved state to that history, and
    # the next write would rightly compute the turns in between: that is the workload's doing,
    # not kvproxy's, so every turn runs on the session's latest history.
    turns: TurnLock = field(default_factory=TurnLock)

    @property
    def expected_header(self) -> str:
        return header_safe(normalise_id(self.raw_id))


@dataclass
class Outcome:
    api: str
    session: int
    kind: str  # write, read, disconnect
    stream: bool
    proxy: int
    seconds: float
    status: int | str
    cache: str | None = None
    shown: str | None = None
    reused: int | None = None
    computed: int | None = None
    text: str = ""
    problem: str | None = None


# -- sessions -----------------------------------------------------------------------------
# Sessions 3, 5, 6 and 7 name themselves with these. A lone surrogate goes where kvproxy does
# not forward it (Anthropic's metadata): llama-server's JSON parser refuses one with a 400.
HOSTILE_IDS = ["soak\u2028line\t\x07", "s" * 3000 + "-long", "default",
               "conv-0123456789abcdef \ud800"]
ID_FIELDS = {"openai": ["header:X-Session-Id", "user", "prompt_cache_key"],
             "anthropic": ["metadata.user_id", "header:X-Claude-Code-Session-Id"],
             "ollama": ["header:X-Session-Id", "session_id"]}


def make_sessions(config: Config, rng: random.Random) -> list[Session]:
    sessions = []
    for n in range(config.sessions):
        api = APIS[n % len(APIS)]
        hostile = [3, 5, 6, 7].index(n) if n in (3, 5, 6, 7) else None
        raw = HOSTILE_IDS[hostile] if hostile is not None else f"soak-{n}-{rng.randrange(10**6)}"
        fields = ID_FIELDS[api]
        field_name = fields[n % len(fields)]
        if field_name.startswith("header:") and not all(ord(c) < 128 and c.isprintable()
                                                        for c in raw):
            field_name = [f for f in fields if not f.startswith("header:")][0]
        system = f"Session {n}. " + long_text(config.system_words, seed=7000 + n)
        sessions.append(Session(n, api, raw, field_name, system))
    return sessions


def request_for(session: Session, messages: list[dict], stream: bool,
                max_tokens: int) -> tuple[str, dict, dict]:
    """Path, headers and body of one turn in the session's API."""
    headers, extra = {}, {}
    if session.id_field.startswith("header:"):
        headers[session.id_field[7:]] = session.raw_id
    elif session.id_field == "metadata.user_id":
        extra["metadata"] = {"user_id": session.raw_id}
    else:
        extra[session.id_field] = session.raw_id
    if session.api == "openai":
        body = {"messages": [{"role": "system", "content": session.system}] + messages,
                "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
        return "/v1/chat/completions", headers, body
    if session.api == "anthropic":
        body = {"model": "soak", "system": session.system, "messages": messages,
                "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
        return "/v1/messages", headers, body
    body = {"model": OLLAMA_MODEL[0], "messages": [{"role": "system", "content": session.system}] + messages,
            "options": {"num_predict": max_tokens, "temperature": 0}, "stream": stream, **extra}
    return "/api/chat", headers, body


# -- reading answers ----------------------------------------------------------------------
def read_whole(api: str, body: dict, outcome: Outcome) -> None:
    if api == "openai":
        timings = body.get("timings") or {}
        outcome.reused, outcome.computed = timings.get("cache_n"), timings.get("prompt_n")
        outcome.text = body["choices"][0]["message"].get("content") or ""
    elif api == "anthropic":
        usage = body["usage"]
        outcome.reused, outcome.computed = usage["cache_read_input_tokens"], usage["input_tokens"]
        outcome.text = "".join(b.get("text", "") for b in body["content"])
    else:
        outcome.computed = body.get("prompt_eval_count")
        outcome.text = body["message"]["content"]


def read_stream(api: str, response: requests.Response, outcome: Outcome,
                leave_after: int | None) -> None:
    """Read a stream to its end (or leave after ``leave_after`` events); errors are problems."""
    events = 0
    text = []
    for line in response.iter_lines():
        if not line:
            continue
        events += 1
        if leave_after is not None and events >= leave_after:
            response.close()
            return
        if api == "ollama":
            event = json.loads(line)
            if "error" in event:
                outcome.problem = f"stream error: {event['error']}"
                return
            text.append(event.get("message", {}).get("content", ""))
            if event.get("done"):
                outcome.computed = event.get("prompt_eval_count")
            continue
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue
        event = json.loads(payload)
        if event.get("error") or event.get("type") == "error":
            outcome.problem = f"stream error: {event.get('error')}"
            return
        if api == "openai":
            for choice in event.get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or "")
            if event.get("timings"):
                outcome.reused = event["timings"].get("cache_n")
                outcome.computed = event["timings"].get("prompt_n")
        elif event.get("type") == "content_block_delta":
            text.append(event["delta"].get("text", ""))
        elif event.get("type") == "message_delta":
            outcome.reused = event["usage"]["cache_read_input_tokens"]
            outcome.computed = event["usage"]["input_tokens"]
    outcome.text = "".join(text)
    if leave_after is None and outcome.computed is None:
        outcome.problem = "stream ended without its final figures"


def check_reuse(session: Session, outcome: Outcome) -> str | None:
    """Do the reused/computed token counts fit a prompt that ran on this session's own state?"""
    warm = outcome.cache in ("hit", "restored", "base")
    floor = session.system_tokens // 2
    if outcome.api in ("openai", "anthropic"):
        if outcome.reused is None:
            return "no reused-token figure"
        if warm and outcome.reused < floor:
            return f"cache {outcome.cache} but only {outcome.reused} tokens reused"
        if not warm and outcome.reused > MISS_REUSE_MAX:
            return f"cache miss but {outcome.reused} tokens reused: another session's state"
    if outcome.computed is None:
        return "no computed-token figure"
    if warm and outcome.computed > session.system_tokens:
        return f"cache {outcome.cache} but {outcome.computed} tokens computed"
    if not warm and outcome.computed < session.system_tokens:
        return f"cache miss but only {outcome.computed} tokens computed: another session's state"
    return None


# -- clients ------------------------------------------------------------------------------
class Soak:
    def __init__(self, config: Config, proxies: list[str], llama_url: str):
        self.config = config
        self.proxies = proxies
        self.llama_url = llama_url
        self.rng = random.Random(config.seed)
        self.sessions = make_sessions(config, self.rng)
        self.outcomes: list[Outcome] = []
        self._outcomes_lock = threading.Lock()

    def measure_system_prompts(self) -> None:
        with requests.Session() as http:
            for session in self.sessions:
                answer = http.post(self.llama_url + "/tokenize",
                                   json={"content": session.system}, timeout=30)
                session.system_tokens = len(answer.json()["tokens"])

    def turn(self, http: requests.Session, rng: random.Random) -> Outcome:
        session = rng.choice(self.sessions)
        kind = "read" if rng.random() < self.config.read_share else "write"
        stream = rng.random() < self.config.stream_share
        if stream and rng.random() < self.config.disconnect_share / self.config.stream_share:
            kind = "disconnect"
        proxy = rng.randrange(len(self.proxies))
        session.turns.take(write=kind == "write")
        history = list(session.history)
        try:
            question = f"Turn {len(history) // 2 + 1}: what is rule {rng.randint(1, 9)}?"
            messages = history + [{"role": "user", "content": question}]
            path, headers, body = request_for(session, messages, stream, self.config.max_tokens
                                              if kind != "disconnect" else 32)
            outcome = Outcome(session.api, session.number, kind, stream, proxy, 0.0, "")
            started = time.monotonic()
            try:
                with http.post(self.proxies[proxy] + path, json=body, headers=headers,
                               stream=stream, timeout=(5, 600)) as response:
                    outcome.status = response.status_code
                    outcome.cache = response.headers.get("X-KVProxy-Cache")
                    outcome.shown = response.headers.get("X-KVProxy-Session")
                    if response.status_code == 200:
                        if stream:
                            read_stream(session.api, response, outcome,
                                        rng.randint(2, 4) if kind == "disconnect" else None)
                        else:
                            read_whole(session.api, response.json(), outcome)
            except requests.RequestException as exc:
                outcome.status = exc.__class__.__name__
            outcome.seconds = time.monotonic() - started
            if outcome.status == 200 and outcome.problem is None:
                if outcome.shown != session.expected_header:
                    outcome.problem = f"ran in {outcome.shown!r}, not {session.expected_header!r}"
                elif kind != "disconnect":
                    outcome.problem = check_reuse(session, outcome)
            if kind == "write" and outcome.status == 200 and not outcome.problem:
                session.history = messages + [{"role": "assistant", "content": outcome.text}]
                if len(session.history) > 24:
                    session.history = []  # a new conversation under the same id
            return outcome
        finally:
            session.turns.give(write=kind == "write")

    def client(self, number: int, deadline: float) -> None:
        rng = random.Random(self.config.seed * 1000 + number)
        with requests.Session() as http:
            while time.monotonic() < deadline:
                outcome = self.turn(http, rng)
                with self._outcomes_lock:
                    self.outcomes.append(outcome)

    def run(self, seconds: float) -> bool:
        """All clients until ``seconds`` pass; False when one did not finish in time."""
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=self.client, args=(n, deadline), daemon=True)
                   for n in range(self.config.clients)]
        for thread in threads:
            thread.start()
        finish_by = deadline + 900
        for thread in threads:
            thread.join(max(0.0, finish_by - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)


# -- process and disk checks ----------------------------------------------------------------
def process_counts(pid: int) -> tuple[int, int]:
    """Threads and open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def slot_is_free(proxies: list[str], llama_url: str) -> list[str]:
    """Each proxy serves a request at once and llama-server is idle."""
    problems = []
    with requests.Session() as http:
        for url in proxies:
            started = time.monotonic()
            reply = http.post(url + "/v1/chat/completions", timeout=(5, 60), json={
                "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})
            waited = time.monotonic() - started
            if reply.status_code != 200 or waited > 30:
                problems.append(f"{url}: {reply.status_code} after {waited:.1f} s")
        slots = http.get(llama_url + "/slots", timeout=10).json()
        if any(slot.get("is_processing") for slot in slots):
            problems.append("llama-server's slot is still processing")
    return problems


# -- report ---------------------------------------------------------------------------------
def percentile(values: list[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def summary(outcomes: list[Outcome], wall: float) -> dict:
    done = [o for o in outcomes if o.status == 200 and o.kind != "disconnect"]
    errors = Counter(f"{o.status}" for o in outcomes if o.status != 200)
    errors.update(o.problem.split(":")[0] for o in outcomes if o.problem)
    seconds = [o.seconds for o in done]
    return {
        "requests": len(outcomes), "answered": len(done),
        "disconnected": sum(o.kind == "disconnect" for o in outcomes),
        "by_api": dict(Counter(o.api for o in outcomes)),
        "streamed": sum(o.stream for o in outcomes),
        "cache": dict(Counter(o.cache for o in done)),
        "errors": dict(errors),
        "p50_s": round(statistics.median(seconds), 3) if seconds else 0.0,
        "p99_s": round(percentile(seconds, 0.99), 3),
        "requests_per_s": round(len(outcomes) / wall, 2) if wall else 0.0,
    }


def run(config: Config, work_dir: Path, out=sys.stdout) -> dict:
    """Start llama-server and two kvproxy processes, soak them, check, report."""
    slot_dir = work_dir / "slots"
    llama = LlamaServer(str(slot_dir), cache_ram_mib=None, log_path=str(work_dir / "llama.log"))
    proxies = [Proxy("", str(slot_dir), log_path=str(work_dir / f"proxy{n}.log"),
                     env={"KVPROXY_LOCK_TIMEOUT": "300", "KVPROXY_THREADS": str(POOL_THREADS)})
               for n in range(2)]
    report: dict = {"config": config.__dict__, "problems": []}
    llama.start()
    try:
        for proxy in proxies:
            proxy.upstream = llama.url
            proxy.start()
        urls = [proxy.url for proxy in proxies]
        OLLAMA_MODEL[0] = requests.get(urls[0] + "/api/tags", timeout=30).json()["models"][0]["name"]
        soak = Soak(config, urls, llama.url)
        soak.measure_system_prompts()
        idle = [process_counts(proxy.worker_pid()) for proxy in proxies]
        print(f"warming up: {config.clients} clients, {config.sessions} sessions, 2 kvproxy "
              f"processes on one slot folder", file=out, flush=True)
        soak.run(min(20.0, config.seconds / 4))  # the thread pools fill up here
        time.sleep(2)
        workers = [proxy.worker_pid() for proxy in proxies]
        before = [process_counts(pid) for pid in workers]
        soak.outcomes.clear()
        print(f"soaking for {config.seconds:.0f} s ...", file=out, flush=True)
        started = time.monotonic()
        finished = soak.run(config.seconds)
        wall = time.monotonic() - started
        if not finished:
            report["problems"].append("deadlock: a client did not finish within 15 minutes")
        time.sleep(3)  # let closing connections settle
        after = [process_counts(pid) for pid in workers]
        report["problems"] += slot_is_free(urls, llama.url)
        report["problems"] += files_match_sidecars(slot_dir)
        for n, (b, a) in enumerate(zip(before, after)):
            # gunicorn starts pool threads on demand, up to KVPROXY_THREADS, and kvproxy
            # its background threads: past the idle count, only more than those is growth.
            if a[0] > max(b[0], idle[n][0] + POOL_THREADS + BACKGROUND_THREADS) \
                    or a[1] > b[1] + 8:
                report["problems"].append(f"kvproxy {n} grew: threads {b[0]} -> {a[0]}, "
                                          f"fds {b[1]} -> {a[1]}")
        report["processes"] = [{"threads": [b[0], a[0]], "fds": [b[1], a[1]]}
                               for b, a in zip(before, after)]
        bad = [o for o in soak.outcomes if o.problem
               or (o.status != 200 and o.status != 503)]
        report["problems"] += [f"{o.api} session {o.session} {o.kind} via {o.proxy}: "
                               f"{o.status} {o.problem or ''}" for o in bad[:20]]
        report["summary"] = summary(soak.outcomes, wall)
        report["slot_files"] = folder_usage(slot_dir).files   # whole files and manifests
        (work_dir / "requests.json").write_text(json.dumps(
            [o.__dict__ | {"text": o.text[:80]} for o in soak.outcomes], indent=1))
    finally:
        for proxy in proxies:
            proxy.stop()
        llama.stop()
    print_report(report, out)
    return report


def print_report(report: dict, out=sys.stdout) -> None:
    s = report.get("summary", {})
    print("\n== soak figures", file=out)
    for key in ("requests", "answered", "disconnected", "streamed", "by_api", "cache", "errors",
                "p50_s", "p99_s", "requests_per_s"):
        print(f"{key:>15}: {s.get(key)}", file=out)
    for n, proc in enumerate(report.get("processes", [])):
        print(f"{'kvproxy ' + str(n):>15}: threads {proc['threads'][0]} -> {proc['threads'][1]}, "
              f"fds {proc['fds'][0]} -> {proc['fds'][1]}", file=out)
    print(f"{'slot files':>15}: {report.get('slot_files')}, each matching its sidecar"
          if not any("sidecar" in p for p in report["problems"]) else "", file=out)
    print(f"{'problems':>15}: {len(report['problems'])}", file=out)
    for problem in report["problems"]:
        print(f"  - {problem}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=8)
    args = parser.parse_args(argv)
    config = Config(clients=args.clients, sessions=args.sessions, seconds=args.seconds)
    work_dir = Path(tempfile.mkdtemp(prefix="kvproxy-soak-"))
    report = run(config, work_dir)
    if report["problems"]:
        print(f"logs, slot folder and every request: {work_dir}")
        return 1
    shutil.rmtree(work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
