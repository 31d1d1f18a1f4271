"""The status page with 1,000 saved sessions: ``python -m bench.status_page [N]``.

Prints the time of ``GET /api/status`` (median of 10) and its size, and the time
headless Chromium takes to draw the page's session table from it. llama-server
is not needed: the app points at a closed port (the page shows it unreachable).
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from werkzeug.serving import make_server

from kvproxy import create_app
from kvproxy.storage.store import SIDECAR_FORMAT


def fill(slot_dir: Path, n: int) -> None:
    """``n`` sessions as kvproxy leaves them: a small slot file and a sidecar each."""
    for i in range(n):
        stem = f"user-{i:05d}-{i:016x}"
        (slot_dir / f"{stem}.bin").write_bytes(b"x" * 4096)
        (slot_dir / f"{stem}.json").write_text(json.dumps({
            "format": SIDECAR_FORMAT, "stem": stem, "session_id": f"user-{i:05d}@example.org",
            "kind": "session", "n_tokens": 1000 + i, "hits": i % 7, "restores": i % 3,
            "last_used_at": f"2026-01-01T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}+00:00",
            "last_cache": "restored", "saved_at": "2026-01-01T00:00:00+00:00"}))


def draw_ms(url: str, n: int) -> tuple[float, float] | None:
    """Milliseconds Chromium takes to redraw every section, layout included: as the page
    opens (the first 200 session rows), and with every session row shown (*Show more*)."""
    chromium = shutil.which("chromium")
    if not chromium:
        return None
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.goto(url + "/status")
        # Polled with evaluate: wait_for_function needs eval, which the page's CSP forbids.
        deadline = time.monotonic() + 60
        while page.evaluate("document.querySelectorAll('#sessions tbody tr').length") < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the session table was not drawn within 60 s")
            time.sleep(0.1)
        # Draw the page again as a refresh with changed data would, and time only that.
        redraw = """() => {
            const t = performance.now();
            state.rendered = {};
            render(state.data);
            document.body.offsetHeight;  // force layout
            return performance.now() - t; }"""
        first = statistics.median(page.evaluate(redraw) for _ in range(5))
        page.evaluate("() => { state.rowsShown = Infinity; }")
        every = statistics.median(page.evaluate(redraw) for _ in range(5))
        rows = page.evaluate("document.querySelectorAll('#sessions tbody tr').length")
        browser.close()
    if rows < n:
        raise RuntimeError(f"only {rows} of {n} session rows were drawn")
    return first, every


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    with tempfile.TemporaryDirectory() as tmp:
        fill(Path(tmp), n)
        app = create_app({"slot_dir": tmp, "upstream": "http://127.0.0.1:9",
                          "connect_timeout": 1, "log_level": "WARNING"})
        server = make_server("127.0.0.1", 0, app, threaded=True)
        url = f"http://127.0.0.1:{server.server_port}"
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            times, size = [], 0
            for _ in range(11):
                started = time.perf_counter()
                response = requests.get(url + "/api/status", timeout=60)
                times.append((time.perf_counter() - started) * 1000)
                size = len(response.content)
            print(f"GET /api/status with {n} saved sessions: median {statistics.median(times[1:]):.0f} ms "
                  f"(min {min(times[1:]):.0f}, max {max(times[1:]):.0f}), {size / 1024:.0f} KiB")
            drawn = draw_ms(url, n)
            if drawn is None:
                print("page redraw: skipped (no chromium)")
            else:
                print(f"page redraw of every section, layout included: {drawn[0]:.0f} ms as it "
                      f"opens (the first 200 session rows), {drawn[1]:.0f} ms with all {n} rows shown")
        finally:
            server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
