"""A session stored as chunks: ``<stem>.chunked``, its manifest and its own tail in one file.

Layout: 8 bytes ``KVPCHUNK``, u32 format, u32 length of the JSON manifest, the manifest,
then the tail (``cut.tail_parts``: the bytes of the slot file no chunk holds, starting with
its header and token list). The manifest names the chunk size, the seed of the keys, the
chunk keys in order and the file's map (``slot_layout.layout_record``). Written under a
temporary name and renamed over the old one, so a reader sees the old manifest or the new.
A format newer than this kvproxy's is refused loudly: it is not guessed at.
"""
from __future__ import annotations

import io
import json
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from kvproxy.upstream import slot_layout

MAGIC = b"KVPCHUNK"
FORMAT = 1
SUFFIX = ".chunked"
HEAD = struct.Struct("<8sII")


class ManifestError(ValueError):
    """Not a manifest this kvproxy can read (damaged, or of a newer format)."""


@dataclass(frozen=True)
class Manifest:
    """What ``<stem>.chunked`` says: the chunks in order and the map of the file they make."""

    chunk_tokens: int
    seed: str
    keys: tuple[str, ...]
    layout: slot_layout.Layout

    @property
    def chunk_bytes(self) -> int:
        return self.layout.bytes_per_token * self.chunk_tokens

    def record(self) -> dict:
        return {"format": FORMAT, "chunk_tokens": self.chunk_tokens, "seed": self.seed,
                "keys": list(self.keys), "layout": slot_layout.layout_record(self.layout)}


def write(path: Path, manifest: Manifest, tail_parts: Iterable) -> int:
    """Write ``path`` atomically; the bytes written."""
    meta = json.dumps(manifest.record(), separators=(",", ":")).encode()
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "wb") as handle:
            written = handle.write(HEAD.pack(MAGIC, FORMAT, len(meta))) + handle.write(meta)
            for part in tail_parts:
                written += handle.write(part)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    return written


def _meta(handle) -> tuple[dict, int]:
    raw = handle.read(HEAD.size)
    if len(raw) != HEAD.size:
        raise ManifestError("too short to be a manifest")
    magic, version, length = HEAD.unpack(raw)
    if magic != MAGIC:
        raise ManifestError("not a manifest")
    if version > FORMAT:
        raise ManifestError(f"written by a newer kvproxy (manifest format {version}, this "
                            f"kvproxy reads up to {FORMAT}): upgrade kvproxy to restore it")
    try:
        return json.loads(handle.read(length)), HEAD.size + length
    except ValueError as exc:
        raise ManifestError(f"damaged manifest: {exc}") from None


def read_meta(path: Path) -> dict:
    """A manifest's JSON part (without reading its tail)."""
    with open(path, "rb") as handle:
        meta, _ = _meta(handle)
    if not isinstance(meta, dict):
        raise ManifestError("damaged manifest: not an object")
    return meta


def meta_of(data: bytes) -> dict:
    """The JSON part of a manifest file's bytes (``ManifestError`` when it is not one)."""
    meta, _ = _meta(io.BytesIO(data))
    if not isinstance(meta, dict):
        raise ManifestError("damaged manifest: not an object")
    return meta


def tail_bytes(path: Path) -> int:
    """The bytes of the tail a manifest file holds (``ManifestError``, ``OSError``)."""
    with open(path, "rb") as handle:
        _, offset = _meta(handle)
        return os.fstat(handle.fileno()).st_size - offset


def read_keys(path: Path) -> tuple[str, ...]:
    """The chunk keys a manifest names (without reading its tail)."""
    return tuple(read_meta(path).get("keys") or ())


def file_size(path: Path) -> int:
    """The size of the slot file a manifest puts back together (0: no readable manifest)."""
    try:
        with open(path, "rb") as handle:
            meta, _ = _meta(handle)
        return int((meta.get("layout") or {}).get("size") or 0)
    except (OSError, ValueError, TypeError):
        return 0


def read(path: Path) -> tuple[Manifest, bytes]:
    """The manifest and its tail (``ManifestError`` when it is not readable)."""
    with open(path, "rb") as handle:
        return _parsed(handle)


def parse(data: bytes) -> tuple[Manifest, bytes]:
    """``read`` of a manifest file's bytes (one fetched from the shared store)."""
    return _parsed(io.BytesIO(data))


def _parsed(handle) -> tuple[Manifest, bytes]:
    meta, _ = _meta(handle)
    tail = handle.read()
    head = slot_layout.head_tokens(tail)
    if head is None:
        raise ManifestError("the tail does not start with a slot file's header")
    try:
        layout = slot_layout.layout_from_record(meta.get("layout") or {}, head)
        return Manifest(int(meta["chunk_tokens"]), str(meta["seed"]), tuple(meta["keys"]),
                        layout), tail
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"damaged manifest: {exc}") from None


def tokens(path: Path) -> list[int] | None:
    """The tokens of the session a manifest stores, None when unreadable."""
    try:
        with open(path, "rb") as handle:
            _meta(handle)
            tail_head = handle.read(12)
            n_values = struct.unpack_from("<I", tail_head, 8)[0] if len(tail_head) == 12 else 0
            found = slot_layout.head_tokens(tail_head + handle.read(4 * n_values))
    except (OSError, ManifestError, struct.error):
        return None
    return list(found) if found is not None else None
