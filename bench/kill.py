"""Nothing lost at a crash: ``python -m bench.kill`` (``make bench-kill``).

A conversation runs turn after turn on the real llama-server behind kvproxy under
gunicorn, each with the default background saves (``KVPROXY_SAVE_BEHIND``). After
each turn has settled, llama-server, kvproxy or both are killed with SIGKILL at a
random moment and started again; the conversation's next turn must be restored from
its file (or, when only kvproxy was killed, found still in the slot) with every token of
its last turn's prompt reused. At the end, every slot
file must match its sidecar. Prints one line a round and the figures.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from bench.readings import files_match_sidecars, sidecar_files
from kvproxy.launch.processes import LlamaServer, ProxyServer

VICTIMS = ("llama-server", "kvproxy", "both")
SETTLE_DELAY = "0.5"    # KVPROXY_SAVE_BEHIND_DELAY for the run: rounds go faster


@dataclass
class Round:
    victim: str
    cache: str          # X-KVProxy-Cache of the turn after the kill
    reused: int         # prompt tokens it reused
    last_prompt: int    # tokens of the prompt of the turn before the kill
    waited: float       # seconds between the turn and the kill (after the save was seen)

    @property
    def kept(self) -> bool:
        """Every token of the last turn's prompt reused: restored from the file, or still in
        the slot (only kvproxy was killed: llama-server kept it, and kvproxy proves it)."""
        return self.cache in ("restored", "hit") and self.reused >= self.last_prompt - 1


class Conversation:
    """One session through kvproxy's OpenAI route: (reply, cache, cached, prompt tokens)."""

    def __init__(self, session: str, system: str):
        self.session = session
        self.messages = [{"role": "system", "content": system}]

    def turn(self, url: str, text: str) -> tuple[str, int, int]:
        self.messages.append({"role": "user", "content": text})
        reply = requests.post(url + "/v1/chat/completions", timeout=300,
                              headers={"X-Session-Id": self.session},
                              json={"messages": self.messages, "max_tokens": 12,
                                    "temperature": 0})
        reply.raise_for_status()
        body = reply.json()
        self.messages.append({"role": "assistant",
                              "content": body["choices"][0]["message"]["content"]})
        usage = body["usage"]
        return (reply.headers["X-KVProxy-Cache"],
                usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"])


def saved_tokens(slot_dir: Path, session: str) -> int:
    """Tokens of the session's file, as its sidecar says (0 without one)."""
    return next((int(sidecar.get("n_tokens") or 0) for _, sidecar in sidecar_files(slot_dir)
                 if sidecar.get("session_id") == session and sidecar.get("saved_at")), 0)


def wait_saved(slot_dir: Path, session: str, at_least: int, timeout: float = 60) -> float:
    """Seconds until the session's file holds ``at_least`` tokens (its turn settled)."""
    started = time.monotonic()
    while saved_tokens(slot_dir, session) < at_least:
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"the turn was not saved behind within {timeout:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - started


def kill(process) -> None:
    """SIGKILL the process and its whole group (gunicorn's master and worker alike)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(10)


def run_rounds(root: Path, rounds: int, seed: int = 1, log=print,
               cycle: bool = False) -> tuple[list[Round], list[str]]:
    """``rounds`` kill rounds on one llama-server and kvproxy over ``root`` (the victim of
    each drawn at random, or in turn with ``cycle``); returns the rounds and the files left
    mismatched."""
    rng = random.Random(seed)
    slot_dir = root / "slots"
    llama = LlamaServer(str(slot_dir), ctx_size=8192, cache_ram_mib=None,
                        log_path=str(root / "llama-server.log"))
    proxy = ProxyServer(llama.url, str(slot_dir), log_path=str(root / "proxy.log"),
                        env={"KVPROXY_SAVE_BEHIND_DELAY": SETTLE_DELAY,
                             "KVPROXY_LOCK_TIMEOUT": "120"})
    words = " ".join(f"rule {i}: keep the lantern lit by the river" for i in range(60))
    chat = Conversation("kill-rounds", f"You keep a handbook. {words}")
    results: list[Round] = []
    llama.start()
    proxy.start()
    try:
        _, _, prompt = chat.turn(proxy.url, "Name the first rule.")
        for number in range(1, rounds + 1):
            expected = prompt  # the file must hold at least the last turn's prompt
            waited = wait_saved(slot_dir, chat.session, expected)
            time.sleep(rng.uniform(0, 0.5))            # a random moment after it settled
            victim = VICTIMS[(number - 1) % len(VICTIMS)] if cycle else rng.choice(VICTIMS)
            if victim in ("kvproxy", "both"):
                kill(proxy.process)
            if victim in ("llama-server", "both"):
                kill(llama.process)
                llama.start()
            if victim in ("kvproxy", "both"):
                proxy.start()
            cache, reused, prompt_now = chat.turn(proxy.url, f"And rule {number + 1}?")
            results.append(Round(victim, cache, reused, expected, waited))
            log(f"round {number:2d}: killed {victim:12s} -> {cache:8s} reused {reused:5d} "
                f"of the last prompt's {expected:5d} tokens "
                f"({'kept' if results[-1].kept else 'LOST'})")
            prompt = prompt_now
    finally:
        proxy.stop()
        llama.stop()
    return results, files_match_sidecars(slot_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvproxy-kill-") as tmp:
        results, problems = run_rounds(Path(tmp), args.rounds, args.seed)
    kept = sum(r.kept for r in results)
    by_victim = {v: sum(1 for r in results if r.victim == v) for v in VICTIMS}
    print(f"\n{kept} of {len(results)} rounds kept every token of the last turn "
          f"(killed: {', '.join(f'{v} {n}' for v, n in by_victim.items())}); "
          f"{len(problems)} files mismatched with their sidecars")
    for problem in problems:
        print("  " + problem)
    return 0 if kept == len(results) and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
