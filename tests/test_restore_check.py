"""The restore check's own bookkeeping: its counts under concurrency."""
from __future__ import annotations

import threading

from kvproxy.slots.restore_check import RestoreCheck

MOMENT = 0.3


def test_two_threads_counting_misses_lose_neither(tmp_path, monkeypatch):
    """Two answers judged at once in one process: filelock with ``thread_local=False`` is
    re-entrant across threads, so its lock alone let both read the same count and write the
    same next one (one miss lost, a switch-off late)."""
    check = RestoreCheck(tmp_path, miss_limit=0, off_minutes=60)
    real_read = check._read
    others: list[threading.Thread] = []

    def read_then_another_thread_counts():
        data = real_read()
        if not others:
            other = threading.Thread(target=check.record, args=("k", False), daemon=True)
            others.append(other)
            other.start()
            other.join(MOMENT)   # finishes here unless the lock keeps it out
        return data
    monkeypatch.setattr(check, "_read", read_then_another_thread_counts)
    check.record("k", False)
    others[0].join(10)
    assert check.entries()["k"]["misses"] == 2
