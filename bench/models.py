"""Returning turns restored from their files against cold prefills, on a sliding-window model
and behind llama-server's router: ``python -m bench.models`` (``make bench-models``).

(a) Gemma 3 270M with ``--swa-full`` behind kvproxy: conversation A (a long system prompt)
    answers a turn, a short conversation B takes the slot (A is saved to its file), and A's
    next turn comes back from the file. The same prompt is then sent straight to llama-server
    on an erased slot (``--cache-ram 0``): a cold prefill.
(b) llama-server ``--models-dir`` with SmolLM2 and Gemma 3 and ``--models-max 1`` behind
    kvproxy: a conversation on each model, alternated, so each returning turn finds its model
    unloaded. The router loads it again (timed apart, from ``/v1/models``: the time the model
    spends ``loading``) and kvproxy restores the conversation from its file. The cold prefill
    is the same prompt sent straight to llama-server with the model loaded and its slot erased;
    without kvproxy a returning turn would pay the load as well.

Each measured request generates at most ``MAX_TOKENS`` tokens; every wait is bounded. The
figures go to ``bench/results/models.json`` and ``models.md`` and to docs/benchmark.md between
its ``bench-models`` markers.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import requests

from kvproxy.launch.processes import LlamaServer, bundled_model, swa_model

from .client import CONNECT_TIMEOUT
from .procs import Proxy
from .readings import cores_and_load
from .report import PAGE, RESULTS, update_page
from .workload import long_text

START, END = "<!-- bench-models:start -->", "<!-- bench-models:end -->"
MAX_TOKENS = 4
READ_TIMEOUT = 300       # one request, however slow the machine
LOAD_TIMEOUT = 180       # one model load in the router
FIRST = "Name the first rule in three words."
SECOND = "And the second rule?"


# -- requests ----------------------------------------------------------------
def chat(url: str, messages: list[dict], *, model: str = "m",
         session: str | None = None, max_tokens: int = MAX_TOKENS, cold: bool = False) -> dict:
    """One chat request on a connection of its own (the router may close kept-alive ones),
    timed: wall seconds, reply, prompt and reused tokens, kvproxy's cache header."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if cold:
        body["cache_prompt"] = False
    headers = {"X-Session-Id": session} if session else {}
    started = time.perf_counter()
    response = requests.post(url + "/v1/chat/completions", json=body, headers=headers,
                         timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
    answer = response.json()
    usage = answer.get("usage") or {}
    timings = answer.get("timings") or {}
    prompt = usage.get("prompt_tokens") or 0
    reused = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if reused is None:
        reused = timings.get("cache_n", 0)
    return {"seconds": seconds, "reply": answer["choices"][0]["message"].get("content") or "",
            "prompt_tokens": prompt, "reused_tokens": reused,
            "computed_tokens": timings.get("prompt_n"),
            "cache": response.headers.get("X-KVProxy-Cache")}


def erase(llama_url: str, model: str | None = None) -> None:
    body = {"model": model} if model else {}
    requests.post(f"{llama_url}/slots/0?action=erase", json=body,
              timeout=(CONNECT_TIMEOUT, 60)).raise_for_status()


def conversation(seed: int, words: int) -> list[dict]:
    return [{"role": "system", "content": long_text(words, seed)},
            {"role": "user", "content": FIRST}]


def next_turn(messages: list[dict], reply: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": SECOND}]


def model_states(llama_url: str) -> dict[str, str]:
    """The router's models and their status (loaded, loading, unloaded)."""
    for attempt in range(3):   # the router may close a kept-alive connection: a new one
        try:
            data = requests.get(llama_url + "/v1/models",
                                timeout=(CONNECT_TIMEOUT, 10)).json()["data"]
            break
        except requests.ConnectionError:
            if attempt == 2:
                raise
            time.sleep(0.5)
    return {m["id"]: (m.get("status") or {}).get("value", "loaded") for m in data}


class LoadWatch:
    """Polls the router's ``/v1/models`` while a request runs: when ``model`` was first seen
    loading and then loaded. ``seconds``: the time it spent loading (None: not seen)."""

    def __init__(self, llama_url: str, model: str, interval: float = 0.05):
        self.url, self.model, self.interval = llama_url, model, interval
        self.began = self.loading_at = self.loaded_at = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "LoadWatch":
        self.began = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT + READ_TIMEOUT
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                state = model_states(self.url).get(self.model)
            except (requests.RequestException, ValueError, KeyError):
                state = None
            now = time.perf_counter()
            if state == "loading" and self.loading_at is None:
                self.loading_at = now
            if state == "loaded" and self.loading_at is not None:
                self.loaded_at = now
                return
            self._stop.wait(self.interval)

    @property
    def seconds(self) -> float | None:
        if self.loaded_at is None or self.loading_at is None:
            return None
        return self.loaded_at - self.loading_at


def wait_loaded(llama_url: str, model: str, timeout: float = LOAD_TIMEOUT
                ) -> float:
    """Have the router load ``model`` (a one-token request) and return the seconds it took."""
    started = time.perf_counter()
    chat(llama_url, [{"role": "user", "content": "hi"}], model=model, max_tokens=1)
    deadline = time.monotonic() + timeout
    while model_states(llama_url).get(model) != "loaded":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model} did not load within {timeout:.0f} s")
        time.sleep(0.1)
    return time.perf_counter() - started


# -- (a) a sliding-window model ----------------------------------------------
def measure_swa(work: Path, words: int) -> dict:
    slots = work / "swa-slots"
    llama = LlamaServer(str(slots), model=swa_model(), ctx_size=8192, cache_ram_mib=0,
                        swa_full=True, log_path=str(work / "swa-llama-server.log"))
    proxy = Proxy(llama.url, str(slots), str(work / "swa-kvproxy.log"))
    try:
        llama.start(timeout=120)
        proxy.start(timeout=60)
        a = conversation(71, words)
        first = chat(proxy.url, a, session="A", max_tokens=8)
        chat(proxy.url, [{"role": "user", "content": "Say yes."}], session="B",
             max_tokens=1)                                  # B takes the slot: A is saved
        again = next_turn(a, first["reply"])
        restored = chat(proxy.url, again, session="A")   # A comes back from its file
        erase(llama.url)
        cold = chat(llama.url, again, cold=True)
        return row("Gemma 3 270M, --swa-full", os.path.basename(swa_model()), restored, cold,
                   first_turn_s=first["seconds"])
    finally:
        proxy.stop()
        llama.stop()


# -- (b) router mode ---------------------------------------------------------
def measure_router(work: Path, words: int) -> list[dict]:
    models = work / "models"
    models.mkdir()
    for path in (bundled_model(), swa_model()):
        os.symlink(os.path.realpath(path), models / os.path.basename(path))
    slots = work / "router-slots"
    llama = LlamaServer(str(slots), models_dir=str(models), models_max=1, ctx_size=4096,
                        cache_ram_mib=0, swa_full=True,
                        log_path=str(work / "router-llama-server.log"))
    proxy = Proxy(llama.url, str(slots), str(work / "router-kvproxy.log"))
    try:
        llama.start(timeout=120)
        proxy.start(timeout=120)
        listed = [m["id"] for m in requests.get(proxy.url + "/v1/models",
                                            timeout=(CONNECT_TIMEOUT, 60)).json()["data"]]
        order = [next(m for m in listed if "SmolLM2" in m), next(m for m in listed if "gemma" in m)]
        history = {m: conversation(81 + i, words) for i, m in enumerate(order)}
        for model in order:        # each first turn; the second loads the other model
            first = chat(proxy.url, history[model], model=model, session=model,
                         max_tokens=8)
            history[model] = next_turn(history[model], first["reply"])
        returning = {}
        for model in order:        # each model was unloaded since its conversation's turn
            if model_states(llama.url).get(model) == "loaded":
                raise RuntimeError(f"{model} is still loaded: --models-max 1 not in effect")
            with LoadWatch(llama.url, model) as watch:
                returning[model] = chat(proxy.url, history[model], model=model,
                                        session=model)
            returning[model]["load_s"] = watch.seconds
        rows = []
        for model in reversed(order):   # the loaded one first: one load less
            load_again = wait_loaded(llama.url, model)
            erase(llama.url, model)
            cold = chat(llama.url, history[model], model=model, cold=True)
            name = "SmolLM2-135M" if "SmolLM2" in model else "Gemma 3 270M"
            rows.append(row(f"router, {name} unloaded and loaded again", model,
                            returning[model], cold, load_s=returning[model]["load_s"],
                            load_again_s=load_again))
        return list(reversed(rows))
    finally:
        proxy.stop()
        llama.stop()


def row(case: str, model: str, restored: dict, cold: dict, **extra) -> dict:
    return {"case": case, "model": model, "prompt_tokens": restored["prompt_tokens"],
            "reused_tokens": restored["reused_tokens"], "cache": restored["cache"],
            "restored_s": round(restored["seconds"], 3), "cold_s": round(cold["seconds"], 3),
            "cold_prompt_tokens": cold["prompt_tokens"],
            "cold_computed_tokens": cold["computed_tokens"],
            **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in extra.items()}}


# -- the report --------------------------------------------------------------
def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def figures(r: dict) -> dict:
    """A row's derived figures: the restored turn without the load, the cold turn with it,
    and how many times faster the restored turn was than what it replaces."""
    load = r.get("load_s")
    without_load = r["restored_s"] - load if load is not None else None
    cold_total = r["cold_s"] + load if load is not None else r["cold_s"]
    return {"restored_without_load_s": without_load, "cold_with_load_s": cold_total,
            "speedup": cold_total / r["restored_s"] if r["restored_s"] > 0 else None}


def table(rows: list[dict]) -> str:
    header = ["case", "prompt tokens", "reused", "restored turn (s)", "of which model load (s)",
              "cold prefill (s)", "cold prefill + load (s)", "speed-up"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        f = figures(r)
        speed = f"{f['speedup']:.1f}x faster" if f["speedup"] else "-"
        lines.append("| " + " | ".join([
            r["case"], str(r["prompt_tokens"]),
            f"{r['reused_tokens']} ({r.get('cache') or '-'})", _s(r["restored_s"]),
            _s(r.get("load_s")), _s(r["cold_s"]),
            _s(f["cold_with_load_s"]) if r.get("load_s") is not None else "-", speed]) + " |")
    return "\n".join(lines)


def page_section(run: dict) -> str:
    m = run["machine"]
    return "\n".join([
        START,
        "## Restored turns on other models (`make bench-models`)",
        "",
        f"Measured {run['date']} on {m['cores']} cores ({m['cpu']}; load average "
        f"{' '.join(map(str, m.get('loadavg') or []))} at the end; the cores are shared, so the "
        "figures are noisy). System prompts of about "
        f"{run['words_swa']} words (Gemma 3, alone) and {run['words_router']} words (router); "
        f"each measured request generates at most {run['max_tokens']} tokens.",
        "",
        table(run["rows"]),
        "",
        "- 'restored turn': the returning turn through kvproxy, which restores the conversation "
        "from its file and computes only the new tokens; in router mode it includes the model's "
        "load (the router loads the model the request names; the load is the time "
        "`/v1/models` shows it `loading`) and kvproxy saving the other model's slot first.",
        "- 'cold prefill': the same prompt sent straight to llama-server on an erased slot with "
        "`--cache-ram 0`, the model already loaded; without kvproxy a returning turn after an "
        "unload pays the load too ('cold prefill + load').",
        "- 'reused': prompt tokens the returning turn took from the restored file (and kvproxy's "
        "X-KVProxy-Cache header).",
        END,
    ])


def write_results(run: dict, folder: Path = RESULTS, page: Path | None = PAGE) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "models.json").write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")
    (folder / "models.md").write_text(page_section(run) + "\n", encoding="utf-8")
    if page is not None and not update_page(page, page_section(run), START, END):
        print(f"{page.name} has no {START} ... {END} section: left as it is")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words-swa", type=int, default=2000,
                        help="words of the Gemma 3 system prompt (about 1.3 tokens a word)")
    parser.add_argument("--words-router", type=int, default=1500,
                        help="words of each router conversation's system prompt")
    parser.add_argument("--only", choices=["swa", "router"], help="one part only")
    parser.add_argument("--no-page", action="store_true", help="leave docs/benchmark.md alone")
    parser.add_argument("--from-json", help="render saved figures again, start nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        run = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
    else:
        rows = []
        with tempfile.TemporaryDirectory(prefix="kvproxy-bench-models-") as work:
            if args.only in (None, "swa"):
                print(f"(a) Gemma 3 270M --swa-full, a {args.words_swa}-word system prompt ...",
                      flush=True)
                rows.append(measure_swa(Path(work), args.words_swa))
                print(json.dumps(rows[-1]), flush=True)
            if args.only in (None, "router"):
                print(f"(b) router, SmolLM2 and Gemma 3, --models-max 1, "
                      f"{args.words_router}-word system prompts ...", flush=True)
                rows += measure_router(Path(work), args.words_router)
                print("\n".join(json.dumps(r) for r in rows[-2:]), flush=True)
        run = {"date": time.strftime("%Y-%m-%d"), "machine": cores_and_load(), "rows": rows,
               "words_swa": args.words_swa, "words_router": args.words_router,
               "max_tokens": MAX_TOKENS}
    print(table(run["rows"]))
    write_results(run, page=None if args.no_page else PAGE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
