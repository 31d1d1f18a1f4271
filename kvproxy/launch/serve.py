"""``make run``: llama-server with the bundled model plus kvproxy under gunicorn.

``LLAMA_SLOTS`` (default 1) sets llama-server's ``-np``: that many conversations
stay in memory and answer side by side, each with ``-c / LLAMA_SLOTS`` tokens of
context. With several slots llama-server's own RAM prompt cache is off
(``--cache-ram 0``): kvproxy pins every request to a slot and keeps the cache
in slot files, and that cache has open bugs that put one conversation into
another's slot. With client API keys it is off too: it is shared by every user.
``LLAMA_CACHE_RAM`` (MiB) overrides it. Unless ``KVPROXY_HOT_DIR`` is set, the
conversations' hot copies go to a folder of this run's in /dev/shm, deleted when it
stops (``run_hot_dir``). Waits until both
answer, prints where to point clients, and stops both on Ctrl-C or SIGTERM.

It supervises them as a service manager would. llama-server is stopped only once
no kvproxy process is left that may still save through it: kvproxy first, then
every process of its group (a gunicorn worker whose master died finishes its
exit save; this process is their subreaper, so it can wait for them). When
llama-server dies on its own, kvproxy keeps answering (503 with Retry-After)
and llama-server is started again with the same flags; the sessions come back
from their files. Both children get SIGTERM if this process dies; every wait
is bounded.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from kvproxy.config import ConfigError, check_slot_dir, load_settings
from kvproxy.launch.processes import LlamaServer, ProxyServer, become_subreaper


SINGLE_SLOT_CACHE_RAM = 16384  # MiB, as before with one slot
RESTART_DELAYS = (0, 1, 2, 5, 10)  # seconds before each try to start llama-server again
POLL = 0.5


class Stopping(Exception):
    """Ctrl-C or SIGTERM while llama-server was being started again."""


def proxy_stop_bound(environ) -> float:
    """Seconds kvproxy may take to stop: gunicorn's graceful timeout, then the exit saves."""
    try:
        return float(environ.get("KVPROXY_GRACEFUL_TIMEOUT") or 120) + 30
    except ValueError:
        return 150.0


def llama_layout(environ) -> tuple[int, int, int]:
    """(slots, context, RAM cache MiB) for llama-server from LLAMA_SLOTS, LLAMA_CTX and
    LLAMA_CACHE_RAM; ValueError names the variable."""
    values = {}
    for name, default, low in (("LLAMA_SLOTS", "1", 1), ("LLAMA_CTX", "8192", 256),
                               ("LLAMA_CACHE_RAM", "", 0)):
        raw = environ.get(name, default)
        if name == "LLAMA_CACHE_RAM" and raw == "":
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            values[name] = low - 1
        if values[name] < low:
            raise ValueError(f"{name}={raw!r} is invalid: expected a whole number from {low}")
    slots = values["LLAMA_SLOTS"]
    # With client keys, llama-server's RAM cache (shared by every user) is off by default.
    keyed = bool(environ.get("KVPROXY_API_KEYS") or environ.get("KVPROXY_API_KEYS_FILE"))
    cache_ram = values.get("LLAMA_CACHE_RAM", SINGLE_SLOT_CACHE_RAM if slots == 1 and not keyed
                           else 0)
    return slots, values["LLAMA_CTX"], cache_ram


def run_hot_dir(environ, settings) -> str | None:
    """A folder in memory for this run's hot copies (``storage.chunks.hot``), when the
    settings name none and the store keeps chunks; the caller deletes it."""
    if "KVPROXY_HOT_DIR" in environ or settings.session_store != "chunks" \
            or not settings.hot_gb or not os.path.isdir("/dev/shm"):
        return None
    return tempfile.mkdtemp(prefix="kvproxy-hot-", dir="/dev/shm")


def main() -> int:
    port = int(os.environ.get("KVPROXY_PORT", "11434"))
    llama_port = int(os.environ.get("LLAMA_PORT", "8080"))
    slot_dir = os.path.abspath(os.environ.get("KVPROXY_SLOT_DIR", "var/slots"))
    log_dir = Path(os.environ.get("KVPROXY_LOG_DIR", "var/log"))
    try:  # a bad setting stops here with one line, before llama-server spends time loading
        settings = load_settings({**os.environ, "KVPROXY_SLOT_DIR": slot_dir})
        check_slot_dir(slot_dir)
        slots, ctx_size, cache_ram = llama_layout(os.environ)
    except (ConfigError, ValueError) as exc:
        print(f"kvproxy: {exc}", file=sys.stderr, flush=True)
        return 2
    log_dir.mkdir(parents=True, exist_ok=True)

    print(f"kvproxy: starting llama-server on port {llama_port} with {slots} slot(s) of "
          f"{ctx_size // slots} tokens (slot files in {slot_dir})", flush=True)
    become_subreaper()
    llama = LlamaServer(slot_dir, port=llama_port, log_path=str(log_dir / "llama-server.log"),
                        slots=slots, ctx_size=ctx_size, cache_ram_mib=cache_ram,
                        die_with_parent=True)
    try:
        llama.start()
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"kvproxy: llama-server did not start ({exc}); see {log_dir}/llama-server.log",
              file=sys.stderr, flush=True)
        return 1
    hot_dir = run_hot_dir(os.environ, settings)
    proxy = ProxyServer(llama.url, slot_dir, port=port, die_with_parent=True,
                        env={"KVPROXY_HOT_DIR": hot_dir} if hot_dir else None)
    if hot_dir:
        print(f"kvproxy: hot copies of recent conversations in {hot_dir} (memory, up to "
              f"{settings.hot_gb:g} GiB; deleted when this stops)", flush=True)

    stopping = False
    restarting = False

    def stop(*_args) -> None:
        nonlocal stopping
        stopping = True
        if restarting:
            raise Stopping()

    def restart_llama() -> bool:
        """Start llama-server again with the same flags; False when it will not come up."""
        nonlocal restarting
        print(f"kvproxy: llama-server exited (code {llama.process.returncode}); starting it "
              "again with the same flags (kvproxy answers 503 with Retry-After meanwhile)",
              flush=True)
        for attempt, delay in enumerate(RESTART_DELAYS, 1):
            deadline = time.monotonic() + delay
            while not stopping and time.monotonic() < deadline:
                time.sleep(min(POLL, delay))
            if stopping:
                return True
            restarting = True
            try:
                llama.start()
                print("kvproxy: llama-server is back; sessions restore from their files",
                      flush=True)
                return True
            except (OSError, RuntimeError, TimeoutError) as exc:
                print(f"kvproxy: llama-server did not start again (try {attempt} of "
                      f"{len(RESTART_DELAYS)}: {exc}); see {log_dir}/llama-server.log",
                      file=sys.stderr, flush=True)
            except Stopping:
                return True
            finally:
                restarting = False
        return False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        try:
            proxy.start()
        except (OSError, RuntimeError, TimeoutError) as exc:
            # Its own one-line reason (a bad setting, a failed start-up check) is printed above.
            print(f"kvproxy: did not start ({exc})", file=sys.stderr, flush=True)
            return 1
        print(f"kvproxy: ready. llama-server {llama.url}, proxy http://127.0.0.1:{port}\n"
              f"  OpenWebUI (Ollama API):  OLLAMA_BASE_URL=http://127.0.0.1:{port}\n"
              f"  OpenAI clients:          base_url=http://127.0.0.1:{port}/v1\n"
              f"  Anthropic clients:       ANTHROPIC_BASE_URL=http://127.0.0.1:{port}\n"
              f"  Sessions:                curl http://127.0.0.1:{port}/api/sessions\n"
              f"  Logs: {log_dir}/llama-server.log. Ctrl-C stops both.", flush=True)
        while not stopping:
            if proxy.process.poll() is not None:
                print(f"kvproxy: kvproxy exited (code {proxy.process.returncode}); waiting for "
                      "its remaining processes to finish their exit saves", flush=True)
                break
            if llama.process.poll() is not None and not restart_llama():
                break
            time.sleep(POLL)
    finally:
        print("kvproxy: stopping", flush=True)
        proxy.stop(proxy_stop_bound(os.environ))  # every kvproxy process has ended (or is killed)
        llama.stop()
        if hot_dir:
            shutil.rmtree(hot_dir, ignore_errors=True)
    return 0 if stopping else 1


if __name__ == "__main__":
    sys.exit(main())
