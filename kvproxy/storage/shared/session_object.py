"""A session as one object of the shared store, and which of two is newer. Pure.

Layout: 8 bytes ``KVPSTORE``, u32 format, u32 length of the JSON head, the head
(``generation``, ``stem``, ``sidecar``), then the ``<stem>.chunked`` file's bytes as the slot
folder keeps them (manifest and tail). One object, so a reader sees a sidecar and manifest of
one save, never of two.

The generation is the save's ``saved_at`` in milliseconds since the epoch (the nodes' clocks
kept by NTP): of two saves of one conversation the later wins, on whichever node it was made.
It is also in the object's user metadata, so HEAD tells it without reading the object, and it
makes two saves' bodies (and so their ETags, the bodies' MD5) differ.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from datetime import datetime

MAGIC = b"KVPSTORE"
FORMAT = 1
HEAD = struct.Struct("<8sII")
GENERATION = "generation"   # the user metadata's field


class SessionObjectError(ValueError):
    """Not a session object this kvproxy reads (damaged, or of a newer format)."""


@dataclass(frozen=True)
class SessionObject:
    generation: int
    stem: str
    sidecar: dict
    manifest: bytes   # the <stem>.chunked file: manifest and tail

    def encode(self) -> bytes:
        head = json.dumps({GENERATION: self.generation, "stem": self.stem,
                           "sidecar": self.sidecar}, separators=(",", ":"),
                          sort_keys=True).encode()
        return HEAD.pack(MAGIC, FORMAT, len(head)) + head + self.manifest

    @property
    def metadata(self) -> dict:
        return {GENERATION: str(self.generation)}


def decode(data: bytes) -> SessionObject:
    if len(data) < HEAD.size:
        raise SessionObjectError("too short to be a session object")
    magic, version, length = HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SessionObjectError("not a session object")
    if version > FORMAT:
        raise SessionObjectError(f"written by a newer kvproxy (format {version}, this kvproxy "
                                 f"reads up to {FORMAT})")
    try:
        head = json.loads(data[HEAD.size:HEAD.size + length])
        return SessionObject(int(head[GENERATION]), str(head["stem"]), dict(head["sidecar"]),
                             data[HEAD.size + length:])
    except (ValueError, KeyError, TypeError) as exc:
        raise SessionObjectError(f"damaged session object: {exc}") from None


def generation_of(sidecar: dict) -> int | None:
    """The generation of a save: its ``saved_at`` in ms since the epoch, None without one."""
    try:
        return int(datetime.fromisoformat(str(sidecar["saved_at"])).timestamp() * 1000)
    except (KeyError, ValueError, TypeError):
        return None


def generation_in(metadata: dict) -> int:
    """The generation a stored object's metadata names (0: none, older than any save)."""
    try:
        return int(metadata.get(GENERATION, 0))
    except (TypeError, ValueError):
        return 0


def replaces(ours: int, theirs: int | None) -> bool:
    """Whether a save of generation ``ours`` goes over the stored one (``None``: none is
    stored): only a newer one does; on a tie the stored one stays (first writer wins)."""
    return theirs is None or ours > theirs
