"""The chunk benchmark's readings: a folder's allocated bytes count a hard-linked chunk once,
kvproxy's swap lines give each restore's time, and the page renders what a run found."""
from __future__ import annotations

import os

from bench import chunks


def test_allocated_bytes_counts_hard_links_once(tmp_path):
    (tmp_path / "chunks").mkdir()
    data = tmp_path / "chunks" / "a"
    data.write_bytes(b"x" * 100_000)
    os.link(data, tmp_path / "b")
    one = chunks.allocated_bytes(tmp_path)
    assert one >= 100_000
    (tmp_path / "c").write_bytes(b"y" * 100_000)
    assert chunks.allocated_bytes(tmp_path) >= one + 100_000


def test_disk_written_counts_what_reaches_the_disk(tmp_path):
    """Bytes written and synced count; a file deleted before write-back is cancelled."""
    before = chunks.disk_written([os.getpid()])
    kept = tmp_path / "kept"
    with open(kept, "wb") as handle:
        handle.write(os.urandom(1 << 20))
        handle.flush()
        os.fsync(handle.fileno())
    after_kept = chunks.disk_written([os.getpid()])
    assert after_kept - before >= 1 << 20
    with open(tmp_path / "gone", "wb") as handle:
        handle.write(os.urandom(4 << 20))
    os.unlink(tmp_path / "gone")
    assert chunks.disk_written([os.getpid()]) - after_kept < 1 << 20


def test_swap_ms_keeps_restores_only(tmp_path):
    log = tmp_path / "proxy.log"
    log.write_text(
        "x swap to session=a source=file cache=restored slot=0 restored_tokens=9 swap_ms=12.5 y\n"
        "x swap to session=b source=none cache=miss slot=0 restored_tokens=0 swap_ms=3.0 y\n"
        "x swap to session=a source=file cache=restored slot=0 restored_tokens=9 swap_ms=14.0\n")
    assert chunks.swap_ms(log) == {"a": [12.5, 14.0]}


def test_report_states_the_ratio_of_restores():
    ten = [{"store": store, "folder_bytes": 10e6, "written_first_turns": [1e6],
            "written_second_turns": [2e6], "restore_ms_median": ms, "second_reuse": [0.99]}
           for store, ms in (("files", 20.0), ("chunks", 25.0))]
    text = chunks.report({"started": "now", "machine": {}, "ten": ten})
    assert "1.25x" in text
