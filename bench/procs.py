"""The processes a benchmark mode runs: llama-server alone, or llama-server plus kvproxy.

Every start and stop is bounded. The proxy runs under gunicorn with the
repository's ``gunicorn.conf.py``, as in production.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from kvproxy.launch.processes import LlamaServer, ProxyServer


class Proxy(ProxyServer):
    """kvproxy under gunicorn, plus what the memory figures need: its worker's pid."""

    def __init__(self, upstream: str, slot_dir: str, log_path: str,
                 env: dict[str, str] | None = None, wsgi_app: str = "wsgi:app"):
        super().__init__(upstream, slot_dir, log_path=log_path, wsgi_app=wsgi_app,
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
        fields = stat_fields(int(entry))
        if fields is not None and len(fields) > 1 and int(fields[1]) == parent:
            found.append(int(entry))
    return sorted(found)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), None when the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


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


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time a process has used, user and system, all its threads; None when it is gone."""
    fields = stat_fields(pid) if pid is not None else None
    return None if fields is None else (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def machine_cpu() -> tuple[float, float]:
    """(busy, total) core-seconds since boot, from /proc/stat: busy is all but idle and
    I/O wait."""
    with open("/proc/stat", encoding="ascii") as handle:
        values = [int(v) for v in handle.readline().split()[1:9]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / TICKS, sum(values) / TICKS


def cpu_used(before: dict, after: dict) -> dict:
    """What ``Mode.cpu`` readings taken around a run say: each process's CPU seconds, the
    machine's busy core-seconds and their share of all cores over the run."""
    used = {name: round(after[name] - before[name], 2) for name in ("llama_server", "kvproxy")
            if before.get(name) is not None and after.get(name) is not None}
    busy = after["machine"][0] - before["machine"][0]
    total = after["machine"][1] - before["machine"][1]
    used["machine_busy"] = round(busy, 2)
    used["machine_busy_share"] = round(busy / total, 3) if total > 0 else None
    return used


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

    def cpu(self) -> dict:
        """CPU readings to take before and after a run (``cpu_used``): llama-server's, the
        proxy's worker's (gunicorn's master only waits) and the machine's."""
        llama = self.llama.process.pid if self.llama.process else None
        worker = self.proxy.worker_pid(timeout=2) if self.proxy else None
        return {"llama_server": cpu_seconds(llama),
                "kvproxy": cpu_seconds(worker),
                "machine": machine_cpu()}

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
