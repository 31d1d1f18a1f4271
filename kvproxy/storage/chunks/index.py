"""Which stored session shares the longest start with a new prompt, by the chunk keys alone.

Every manifest lists its chunk keys in order, and a key stands for the whole token prefix up
to its chunk's end: so the number of leading keys a session shares with the prompt's own
keys (computed with the session's seed) is how many tokens of the prompt its file holds.
The manifests' keys are read once and again only when a manifest changes (its size and
modification time), so a lookup costs a directory scan and one hash per chunk of the prompt.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from kvproxy.storage.chunks import cut, manifest


@dataclass(frozen=True)
class Indexed:
    seed: str
    chunk_tokens: int
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Prefix:
    """A stored session and how many leading tokens of the prompt its file holds."""

    stem: str
    tokens: int


class PrefixIndex:
    """The manifests of one slot folder, kept by stem."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, int]] = {}   # stem -> (mtime_ns, size)
        self._entries: dict[str, Indexed] = {}

    def refresh(self) -> dict[str, Indexed]:
        """The manifests as they are now (changed ones read again, gone ones dropped)."""
        with self._lock:
            seen = {}
            try:
                entries = list(os.scandir(self.root))
            except OSError:
                entries = []
            for entry in entries:
                if not entry.name.endswith(manifest.SUFFIX) or entry.name.startswith("."):
                    continue
                stem = entry.name[:-len(manifest.SUFFIX)]
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                seen[stem] = (stat.st_mtime_ns, stat.st_size)
                if self._seen.get(stem) != seen[stem] or stem not in self._entries:
                    try:
                        meta = manifest.read_meta(Path(entry.path))
                        self._entries[stem] = Indexed(str(meta["seed"]), int(meta["chunk_tokens"]),
                                                      tuple(meta["keys"]))
                    except (OSError, ValueError, KeyError, TypeError):
                        self._entries.pop(stem, None)
            for stem in set(self._entries) - set(seen):
                del self._entries[stem]
            self._seen = seen
            return dict(self._entries)

    def longest(self, tokens: Callable[[], Sequence[int]],
                accept: Callable[[str], bool]) -> Prefix | None:
        """The accepted session sharing the most whole chunks with the prompt (None: none
        shares one); ties go to the shortest file (less to restore). ``tokens`` is asked
        only when some session is accepted (tokenizing is a round trip to llama-server)."""
        best: Prefix | None = None
        best_len = 0
        prompt_keys: dict[tuple[str, int], list[str]] = {}
        accepted = [(stem, entry) for stem, entry in sorted(self.refresh().items())
                    if entry.keys and accept(stem)]
        if not accepted:
            return None
        prompt = tokens()
        for stem, entry in accepted:
            mine = prompt_keys.get((entry.seed, entry.chunk_tokens))
            if mine is None:
                mine = cut.chunk_keys(entry.seed, prompt, entry.chunk_tokens)
                prompt_keys[(entry.seed, entry.chunk_tokens)] = mine
            shared = 0
            for theirs, ours in zip(entry.keys, mine):
                if theirs != ours:
                    break
                shared += 1
            n = shared * entry.chunk_tokens
            if n and (best is None or n > best.tokens or
                      (n == best.tokens and len(entry.keys) < best_len)):
                best, best_len = Prefix(stem, n), len(entry.keys)
        return best
