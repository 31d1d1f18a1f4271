"""What the disk budget costs per save: the sidecar scan behind the size estimate and the
eviction plan, for a slot folder of many sessions. Prints milliseconds per save.

    python -m bench.disk_budget [sessions]
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from kvproxy.storage.budget import DiskBudget
from kvproxy.storage.store import SessionStore, now_iso


def main(sessions: int = 500, rounds: int = 50) -> None:
    with tempfile.TemporaryDirectory() as folder:
        store = SessionStore(folder)
        for n in range(sessions):
            stem = f"s{n}-{n:016x}"
            (Path(folder) / f"{stem}.bin").write_bytes(bytes(64))
            store.update_sidecar(stem, {"session_id": f"s{n}", "kind": "session"}, saved_at=now_iso(),
                                 n_tokens=60, saved_bytes=64, made_by={"model_path": "m"})
        budget = DiskBudget(store, max_bytes=64 * sessions * 2, min_free=1024**3)
        started = time.perf_counter()
        for _ in range(rounds):
            budget.make_room("s0-0000000000000000", 120, {"model_path": "m"}, {"s0"})
        per_save = (time.perf_counter() - started) / rounds * 1000
    print(f"disk budget before a save, {sessions} sessions in the folder: {per_save:.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 500)
