"""No-swap overhead against a bare Flask relay, same run: ``python -m bench.overhead``
(``make bench-overhead``).

One llama-server (the bundled model, one slot), kvproxy and ``bench.passthrough`` (a Flask
relay that only forwards the body) each under the repository's gunicorn settings. The same
tiny request goes straight to llama-server, through kvproxy and through the relay, in a
shuffled order each round (``micro.overhead``); what each proxy adds is its median minus the
direct median, and the ratio of the two is kvproxy's cost against the floor of any Flask +
gunicorn + requests proxy on this machine. ``--saved N`` puts N other users' conversations
(sidecars with a trail) in the slot folder first, as a busy server's folder holds: what
kvproxy does per request that grows with the folder shows there. ``--without session,slot``
runs kvproxy with those parts cut out (``bench.overhead_without``): how far the ratio can fall
when they cost nothing.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kvproxy.launch.processes import LlamaServer
from kvproxy.sessions import matching
from kvproxy.sessions.identity import Session
from kvproxy.storage.store import SessionStore

from . import micro
from .overhead_without import PARTS, named_parts
from .procs import Proxy


def parts(text: str) -> tuple[str, ...]:
    """``--without``'s value: known part names (``overhead_without.named_parts``)."""
    try:
        return named_parts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fill(folder: Path, saved: int) -> None:
    """``saved`` sidecars of other users' conversations (no slot file: only their sidecars
    are read per request), each with the trail an anonymous request is matched against."""
    store = SessionStore(folder)
    for n in range(saved):
        chat = [{"role": "system", "content": f"Rules of another user's agent, number {n}. " * 60},
                {"role": "user", "content": "Hello."}]
        session = Session(f"other-{n}", "conversation-hash")
        store.update_sidecar(f"other-{n}", {"session_id": session.id, "kind": "session"},
                             trail=matching.trail_of(chat).record(session, "another-user"))


def measure(rounds: int, work: Path, log=print, saved: int = 0,
            without: tuple[str, ...] = ()) -> dict:
    """``micro.overhead``'s figures for kvproxy (``without`` those parts) and the bare relay
    against one llama-server."""
    fill(work, saved)
    llama = LlamaServer(str(work), slots=1, ctx_size=2048, cache_ram_mib=0,
                        log_path=str(work / "llama.log"))
    proxy = bare = None
    try:
        llama.start()
        cut = {"KVPROXY_BENCH_WITHOUT": ",".join(without)} if without else {}
        proxy = Proxy(llama.url, str(work), str(work / "kvproxy.log"),
                      env={"KVPROXY_LOG_LEVEL": "WARNING", **cut},
                      wsgi_app="bench.overhead_without:build()" if without else "wsgi:app"
                      ).start()
        bare = Proxy(llama.url, str(work), str(work / "bare.log"),
                     wsgi_app="bench.passthrough:app").start(timeout=60)
        return micro.overhead(proxy.url, llama.url, rounds, log, bare.url)
    finally:
        for process in (bare, proxy, llama):
            if process is not None:
                process.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1000,
                        help="rounds of one request each way (default 1000: medians of 300 "
                             "still moved by a few tenths of a millisecond from run to run)")
    parser.add_argument("--saved", type=int, default=0,
                        help="other users' saved conversations in the slot folder (default 0)")
    parser.add_argument("--without", type=parts, default=(),
                        help="cut these parts out of kvproxy's path, comma-separated: "
                             f"{', '.join(PARTS)} (bench/overhead_without.py)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvproxy-overhead-") as work:
        print(f"llama-server, kvproxy and a bare Flask relay; {args.rounds} shuffled rounds of "
              f"one tiny no-swap request each way; {args.saved} other conversations saved"
              + (f"; kvproxy without its {' and '.join(args.without)}" if args.without else "")
              + " ...", flush=True)
        figures = measure(args.rounds, Path(work), saved=args.saved, without=args.without)
    added, floor = figures["added_median_ms"], figures["bare"]["added_median_ms"]
    if figures["requests_not_hit"] and "slot" not in args.without:
        print(f"  warning: {figures['requests_not_hit']} request(s) through kvproxy were not hits")
    print(f"  direct: median {figures['direct_median_ms']:.2f} ms")
    print(f"  kvproxy adds {added:+.2f} ms (median), the bare relay {floor:+.2f} ms: "
          f"{added / floor:.2f}x the relay's cost" if floor > 0 else "  the relay added nothing")
    beyond = statistics.median(p - b for p, b in zip(figures["proxy_ms"], figures["bare_ms"]))
    print(f"  kvproxy's own cost beyond the relay, round by round: median {beyond:+.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
