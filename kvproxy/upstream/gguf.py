"""Read the scalar metadata of a GGUF model file from its header.

llama-server does not report a model's architecture; the GGUF header is the
honest source when kvproxy can read the file.
"""
from __future__ import annotations

import functools
import os
import struct
from typing import Any, BinaryIO

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_value(f: BinaryIO, kind: int) -> Any:
    """One GGUF value; arrays (tokenizer tables) are skipped and come back as None."""
    def unpack(fmt: str) -> Any:
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _GGUF_STRING:
        size = unpack("<Q")
        if size > 1 << 24:
            raise ValueError("implausible GGUF string length")
        return f.read(size).decode("utf-8", "replace")
    if kind == _GGUF_ARRAY:
        item_kind, count = unpack("<I"), unpack("<Q")
        if item_kind in _GGUF_SCALARS:
            f.seek(count * struct.calcsize(_GGUF_SCALARS[item_kind]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _gguf_value(f, item_kind)
        return None
    if kind not in _GGUF_SCALARS:
        raise ValueError(f"unknown GGUF value type {kind}")
    return unpack(_GGUF_SCALARS[kind])


def read_gguf_metadata(f: BinaryIO, max_keys: int = 4096) -> dict:
    """Scalar metadata of a GGUF file (general.*, <arch>.*), read from its header only.

    llama-server does not expose the architecture, so this is the honest source of
    ``general.architecture``. A damaged header yields what was read before the damage.
    """
    out: dict = {}
    try:
        if f.read(4) != b"GGUF" or struct.unpack("<I", f.read(4))[0] < 2:
            return out
        _tensors, n_keys = struct.unpack("<QQ", f.read(16))
        for _ in range(min(n_keys, max_keys)):
            key = _gguf_value(f, _GGUF_STRING)
            value = _gguf_value(f, struct.unpack("<I", f.read(4))[0])
            if value is not None and not key.startswith("tokenizer."):
                out[key] = value
    except (struct.error, ValueError, OSError):
        pass
    return out


@functools.lru_cache(maxsize=4)
def _cached(path: str, size: int, mtime_ns: int) -> dict:
    with open(path, "rb") as f:
        return read_gguf_metadata(f)


def file_facts(path: str) -> tuple[dict, int | None, float | None]:
    """GGUF metadata, size and mtime of the model file when kvproxy can read it."""
    try:
        stat = os.stat(path)
        return _cached(path, stat.st_size, stat.st_mtime_ns), stat.st_size, stat.st_mtime
    except OSError:
        return {}, None, None


def model_file(facts: dict) -> tuple[dict, int | None, float | None]:
    """``file_facts`` of the model file a server view's model facts name (their /props'
    ``model_path``), as the Ollama model routes describe it."""
    return file_facts(facts["props"].get("model_path") or "")


def sliding_window(metadata: dict) -> int | None:
    """The sliding window of an SWA model (Gemma 3, gpt-oss, ...), from its GGUF header, else
    None. llama-server keeps only the window of such layers unless started with ``--swa-full``,
    and then cannot reuse a restored slot past it."""
    for key, value in metadata.items():
        if key.endswith(".attention.sliding_window") and isinstance(value, int) and value > 0:
            return value
    return None
