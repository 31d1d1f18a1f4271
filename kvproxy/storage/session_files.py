"""What the slot switch needs of a store of saved sessions: one interface, several stores.

``SessionFiles`` is the whole of it: a checked save put in place, a file looked up and
judged, the name llama-server restores it from, setting a bad file aside, deleting,
listing, the disk budget and the start-up sweep. The slot folder (``FolderFiles``) is its
first implementation; a store of shared chunks, or one on another machine, implements it
again, so the switch and its executor never change for them. llama-server itself only
ever reads and writes plain files in its ``--slot-save-path``: a store that keeps sessions
elsewhere puts a file there before a restore and takes it from there after a save. The
store of shared chunks (``chunks.files.ChunkedFiles``) is the second implementation.

Its failures are ``SaveFailed`` (the save is dropped, the session's old file and sidecar
stay as they were, or both go) and ``NotAsRecorded`` (llama-server saved another token
count than the caller recorded: the slot holds something else), both ``StorageError``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, ContextManager, Iterable, Protocol

from kvproxy.storage.checked_save import NotAsRecorded, SaveFailed  # noqa: F401 - its failures
from kvproxy.storage.chunks.index import Prefix
from kvproxy.telemetry.pace import Pace


class DroppedSavesView(Protocol):
    """Saves the store could not take (``budget.DroppedSaves``)."""

    count: int
    last: dict | None

    def note(self, stem: str, session_id: str, reason: str) -> None: ...


class SessionFiles(Protocol):
    """A store of saved sessions and base snapshots, each named by its stem."""

    dropped: DroppedSavesView

    # -- save: checked, then put in place ----------------------------------------
    def save(self, stem: str, write: Callable[[str], dict],
             describe: Callable[[dict, int], dict],
             as_recorded: Callable[[object], bool]) -> dict | None:
        """Have llama-server write the slot (``write(name)``: its save into ``name`` in its
        slot folder, returning its answer), check what it wrote, and put the file and its
        sidecar in place of the old ones: the sidecar there with the save's fields
        (``describe(answer, size)``) laid over it under the stem's lock. The new sidecar, or
        None when the slot was empty; ``SaveFailed`` or ``NotAsRecorded`` leave the old
        pair as it was."""
        ...

    def scratch_path(self, stem: str) -> Path:
        """Where a save of ``stem`` lies while ``describe`` runs (to read its header)."""
        ...

    # -- look up, restore, set aside, delete, list --------------------------------
    def has(self, stem: str) -> bool:
        """Whether a saved file of ``stem`` exists."""
        ...

    def fetch(self, stem: str, prefill: Pace | None = None) -> bool:
        """Bring ``stem`` from a store behind this one when it is missing here (the shared
        store); whether it is here now. Never raises: a failure, or a fetch slower than
        computing the prompt at ``prefill``'s pace (tokens per second), means computing it."""
        ...

    def check(self, stem: str) -> tuple[dict | None, str | None]:
        """The file's sidecar, and why the file does not match it (None: it does)."""
        ...

    def staged(self, stem: str) -> ContextManager[str]:
        """The name llama-server restores ``stem`` from, in its slot folder, while the block
        runs (a store that keeps files elsewhere puts the file there first and removes it
        after); ``StorageError`` when it cannot."""
        ...

    def tokens(self, stem: str) -> list[int] | None:
        """The tokens of the session saved as ``stem`` (None: unreadable or gone)."""
        ...

    def longest_prefix(self, tokens: Callable[[], list[int]], accept: Callable[[str], bool]) -> Prefix | None:
        """The stored session ``accept`` allows whose file holds the longest start of the
        prompt (``tokens()``, asked only when needed); None: none, or a store that cannot tell."""
        ...

    def set_aside(self, stem: str, reason: str) -> str:
        """Keep a file that will not be restored out of the way; says where it went."""
        ...

    def delete(self, stem: str) -> bool:
        """Delete the file and its sidecar; False when neither existed."""
        ...

    def sidecars(self) -> list[dict]:
        """Every sidecar, with its file's size in ``file_bytes``."""
        ...

    # -- the budget ------------------------------------------------------------------
    def saving(self) -> ContextManager[None]:
        """Hold the store's save lock: one save at a time (``SaveFailed`` after a bound)."""
        ...

    def pinned(self, stems: Iterable[str]) -> ContextManager[None]:
        """Keep ``stems`` from eviction while the block runs (a swap may restore them)."""
        ...

    def make_room(self, stem: str, tokens: int, made_by: dict | None,
                  keep: set[str]) -> int:
        """Before a save of about ``tokens``: evict what the budget says, or raise
        ``SaveFailed`` and delete nothing. Returns the estimated bytes."""
        ...

    def trim(self, keep: set[str]) -> None:
        """After a save bigger than estimated: back within the bound."""
        ...

    def problem(self) -> str | None:
        """What is wrong with the store now (for /health and the status page), or None."""
        ...

    # -- start-up --------------------------------------------------------------------
    def sweep(self) -> list[str]:
        """Clean what a crash left; one line per action (run with every slot locked)."""
        ...
