"""The processes a benchmark mode runs: llama-server alone, or llama-server plus kvproxy.

Every start and stop is bounded. The proxy runs under gunicorn with the
repository's ``gunicorn.conf.py``, as in production.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from kvproxy.launch.processes import LlamaServer, ProxyServer

ROOT = Path(__file__).resolve().parent.parent


class Proxy(ProxyServer):
    """kvproxy under gunicorn, plus what the memory figures need: its worker's pid."""

    def __init__(self, upstream: str, slot_dir: str, log_path: str, port: int | None = None,
                 env: dict[str, str] | None = None, wsgi_app: str = "wsgi:app"):
        super().__init__(upstream, slot_dir, port=port, log_path=log_path, wsgi_app=wsgi_app,
                         env={"KVPROXY_LOCK_TIMEOUT": "300", "KVPROXY_LOG_LEVEL": "INFO",
                              **(env or {})})

    def worker_pid(self, timeout: float = 10) -> int | None:
        """The gunicorn worker: the child of the master process."""
        if self.process is None:
            return None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            children = child_pids(self.process.pid)
            if children:
                return children[0]
            time.sleep(0.1)
        return None


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` (from /proc/<pid>/stat)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            found.append(int(entry))
    return sorted(found)


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB, None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Mode:
    """One side of the comparison: its own llama-server, its own slot folder, maybe a proxy."""

    def __init__(self, key: str, label: str, workdir: Path, cache_ram_mib: int | None,
                 proxied: bool, ctx_size: int = 8192, llama_options: dict | None = None,
                 proxy_env: dict[str, str] | None = None):
        """``llama_options`` (LlamaServer keyword arguments) replace ``cache_ram_mib`` and
        ``ctx_size`` when given; ``proxy_env`` is added to kvproxy's environment."""
        self.key = key
        self.label = label
        self.workdir = workdir
        self.slot_dir = workdir / "slots"
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        options = llama_options if llama_options is not None else \
            {"cache_ram_mib": cache_ram_mib, "ctx_size": ctx_size}
        self.llama = LlamaServer(str(self.slot_dir), log_path=str(workdir / "llama-server.log"),
                                 **options)
        self.proxy = Proxy(self.llama.url, str(self.slot_dir), str(workdir / "proxy.log"),
                           env=proxy_env) if proxied else None

    @property
    def llama_url(self) -> str:
        return self.llama.url

    @property
    def url(self) -> str:
        """Where clients send their requests."""
        return self.proxy.url if self.proxy else self.llama.url

    def start(self) -> float:
        started = time.monotonic()
        self.llama.start(timeout=120)
        if self.proxy:
            self.proxy.start(timeout=60)
        return time.monotonic() - started

    def restart(self) -> float:
        """Restart llama-server (and the proxy): every in-memory cache is gone afterwards."""
        started = time.monotonic()
        if self.proxy:
            self.proxy.stop()
        self.llama.restart(timeout=120)
        if self.proxy:
            self.proxy.start(timeout=60)
        return time.monotonic() - started

    def stop(self) -> None:
        try:
            if self.proxy:
                self.proxy.stop()
        finally:
            self.llama.stop()
