"""Which chunks of the bucket a sweep deletes. Pure.

A chunk goes only when no session object of its user prefix names it and it was last written
more than ``grace`` seconds ago: an upload writes its chunks before the session object that
names them, so a chunk younger than any upload may be about to be named.
"""
from __future__ import annotations

from typing import Iterable


def doomed(chunks: Iterable, named: set[str], now: float, grace: float) -> list:
    """The listed chunks (``bucket.Listed``: ``key``, ``modified``) to delete: those whose
    object name is not in ``named`` and whose ``modified`` is older than ``now - grace``."""
    return [chunk for chunk in chunks
            if chunk.key not in named and now - chunk.modified > grace]
