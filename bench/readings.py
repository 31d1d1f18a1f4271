"""What a benchmark reads back besides its own requests: kvproxy's counters, the slot folder's
sidecars and files, and the machine it ran on.

Every scenario records these the same way; they live here, apart from the scenarios, so that
no benchmark module has to import another scenario to read them.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import requests

from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.store import CHUNKED_SUFFIX, SessionStore

METRICS = ("kvproxy_swaps_total", "kvproxy_swap_bytes_total", "kvproxy_prompt_tokens_total",
           "kvproxy_restore_misses_total", "kvproxy_swap_seconds_sum",
           "kvproxy_swap_seconds_count", "kvproxy_lock_wait_seconds_sum",
           "kvproxy_slot_dir_bytes", "kvproxy_slot_dir_files", "kvproxy_evictions_total")
SIDECAR_FIELDS = ("stem", "kind", "n_tokens", "n_bytes", "save_ms", "restore_ms", "restores",
                  "hits", "last_cache", "prefill_computed")


def scrape_metrics(url: str) -> dict:
    """A few kvproxy counters from /metrics, summed by family and label."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict = {}
    text = requests.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in METRICS:
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


def sidecar_files(slot_dir: Path) -> Iterator[tuple[Path, dict]]:
    """Every sidecar of the slot folder that reads as a JSON object, with its path, by name."""
    for path in sorted(slot_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            yield path, data


def sidecars(slot_dir: Path) -> list[dict]:
    """The figures of every sidecar in the slot folder, by file name."""
    return [{k: data.get(k) for k in SIDECAR_FIELDS} for _, data in sidecar_files(slot_dir)
            if "stem" in data]


def files_match_sidecars(slot_dir: Path) -> list[str]:
    """Saved sessions (whole files or manifests of chunks) without a sidecar, or that do not
    give back what llama-server said it wrote (a missing chunk, a torn tail, a short file)."""
    store = SessionStore(slot_dir)
    files = ChunkedFiles(store)
    problems = []
    for suffix in (".bin", CHUNKED_SUFFIX):
        for path in sorted(slot_dir.glob(f"*{suffix}")):
            if path.name.endswith((".saving.bin", ".restoring.bin")) or path.name.startswith("."):
                continue
            stem = path.name[:-len(suffix)]
            if not store.sidecar_path(stem).exists():
                problems.append(f"{path.name}: no sidecar")
                continue
            sidecar, problem = files.check(stem)
            expected = (sidecar or {}).get("n_bytes")
            if problem:
                problems.append(f"{path.name}: {problem}")
            elif expected is not None and expected != store.bin_bytes(stem):
                problems.append(f"{path.name}: {store.bin_bytes(stem)} bytes, sidecar says {expected}")
    return problems


def machine() -> dict:
    """Cores, CPU model, RAM, kernel and Python, as ``bench.run``'s results record them."""
    info = {"cores": os.cpu_count(), "cpu": None, "ram_gib": None, "kernel": os.uname().release,
            "python": sys.version.split()[0]}
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo", encoding="utf-8"):
            if line.startswith("MemTotal:"):
                info["ram_gib"] = round(int(line.split()[1]) / 1024 / 1024, 1)
                break
    except OSError:
        pass
    return info


def cores_and_load() -> dict:
    """Cores, processor and load average now, as the models and idle-residents results
    record them."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "loadavg": load}


def loadavg() -> list[float]:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return []
