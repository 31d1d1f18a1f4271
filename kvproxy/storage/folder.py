"""The slot folder as a ``SessionFiles`` store: files where llama-server saves them.

The first implementation of ``session_files.SessionFiles``: a session's file is
``<stem>.bin`` in llama-server's ``--slot-save-path`` itself, with its sidecar beside it
(``store.SessionStore``), saved by ``checked_save``, judged and set aside by
``quarantine``, swept by ``sweep`` and kept within ``budget.DiskBudget``.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator

from kvproxy.storage import checked_save, quarantine, sweep
from kvproxy.storage.budget import DiskBudget, DroppedSaves
from kvproxy.storage.store import SessionStore
from kvproxy.telemetry.pace import Pace


class FolderFiles:
    """Saved sessions as files in the slot folder, within a disk budget."""

    def __init__(self, store: SessionStore, max_bytes: int = 0, min_free: int = 0):
        self.store = store
        self.budget = DiskBudget(store, max_bytes, min_free)

    @property
    def dropped(self) -> DroppedSaves:
        return self.budget.dropped

    @dropped.setter
    def dropped(self, dropped: DroppedSaves) -> None:
        self.budget.dropped = dropped

    def save(self, stem: str, write: Callable[[str], dict],
             describe: Callable[[dict, int], dict],
             as_recorded: Callable[[object], bool] = lambda n_saved: True) -> dict | None:
        return checked_save.checked_save(write, self.store, stem, describe, as_recorded)

    def scratch_path(self, stem: str) -> Path:
        return checked_save.temp_path(self.store, stem)

    def has(self, stem: str) -> bool:
        return self.store.has_bin(stem)

    def fetch(self, stem: str, prefill: Pace | None = None) -> bool:
        """One folder, nothing to fetch from (``ChunkedFiles`` fetches from a shared store)."""
        return False

    def check(self, stem: str) -> tuple[dict | None, str | None]:
        return quarantine.file_check(self.store, stem)

    @contextlib.contextmanager
    def staged(self, stem: str) -> Iterator[str]:
        yield self.store.bin_path(stem).name

    def tokens(self, stem: str) -> list[int] | None:
        return self.store.saved_tokens(stem)

    def longest_prefix(self, tokens: Callable[[], list[int]], accept: Callable[[str], bool]) -> None:
        return None   # whole files are not indexed by their chunks

    def set_aside(self, stem: str, reason: str) -> str:
        return quarantine.set_aside(self.store, stem, reason)

    def delete(self, stem: str) -> bool:
        return self.store.delete(stem)

    def sidecars(self) -> list[dict]:
        return self.store.sidecars()

    def saving(self) -> ContextManager[None]:
        return self.budget.saving()

    def pinned(self, stems: Iterable[str]) -> ContextManager[None]:
        return self.budget.pinned(stems)

    def make_room(self, stem: str, tokens: int, made_by: dict | None,
                  keep: set[str]) -> int:
        return self.budget.make_room(stem, tokens, made_by, keep)

    def trim(self, keep: set[str]) -> None:
        self.budget.trim(keep)

    def problem(self) -> str | None:
        return self.budget.problem()

    def sweep(self) -> list[str]:
        return sweep.sweep(self.store)
