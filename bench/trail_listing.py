"""What the trail index's listing of the slot folder costs anonymous requests:
``python -m bench.trail_listing --saved 1000``.

An anonymous conversation is matched against the trails of the folder's sidecars, and the
folder is listed again once a second (a stat per sidecar). With many saved conversations
one request a second paid that listing; now a thread does it. This drives kvproxy's app in
this process (its test client, so only kvproxy's own work is timed, not gunicorn's or a
client's) against a real llama-server, with ``--saved`` other users' conversations in the
folder, for ``--seconds``, and prints how long resolving each request's session took.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvproxy import create_app
from kvproxy.launch.processes import LlamaServer
from kvproxy.ops.startup import check_at_start
from kvproxy.relay.relay import Relay

from .micro import percentile
from .overhead import fill

BODY = {"messages": [{"role": "user", "content": "Reply with the word yes."}],
        "max_tokens": 1, "temperature": 0}


def measure(saved: int, seconds: float, work: Path) -> list[float]:
    """Milliseconds ``Relay.session_for`` took for each request of ``seconds`` of requests."""
    fill(work, saved)
    llama = LlamaServer(str(work), slots=1, ctx_size=2048, cache_ram_mib=0,
                        log_path=str(work / "llama.log"))
    times: list[float] = []
    resolve = Relay.session_for

    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return resolve(self, *args, **kwargs)
        finally:
            times.append((time.perf_counter() - started) * 1000)
    try:
        llama.start()
        app = create_app({"upstream": llama.url, "slot_dir": str(work), "log_level": "WARNING"})
        check_at_start(app)
        client = app.test_client()
        Relay.session_for = timed
        for _ in range(5):   # the first lists the folder and swaps the slot in
            client.post("/v1/chat/completions", json=BODY).close()
        times.clear()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            response = client.post("/v1/chat/completions", json=BODY)
            response.close()
            if response.status_code != 200:
                raise SystemExit(f"kvproxy answered {response.status_code}")
    finally:
        Relay.session_for = resolve
        llama.stop()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saved", type=int, default=1000,
                        help="other users' saved conversations in the folder (default 1000)")
    parser.add_argument("--seconds", type=float, default=10,
                        help="how long requests are sent, one after another (default 10)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvproxy-trails-") as work:
        print(f"{args.saved} saved conversations; anonymous requests for {args.seconds:.0f} s "
              f"through kvproxy's app ...", flush=True)
        times = measure(args.saved, args.seconds, Path(work))
    print(f"  resolving the session of {len(times)} requests: median "
          f"{statistics.median(times):.2f} ms, p99 {percentile(times, 99):.2f} ms, "
          f"max {max(times):.2f} ms; {sum(t > 1 for t in times)} over 1 ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
