"""What a llama-server slot file holds, read from its header: the tokens and the KV format.

llama-server refuses to restore a file written with other KV cache types or another
flash-attention layout ("invalid slot save file"), and ``/props`` reports neither. The
file itself says both, so kvproxy reads them from a probe file at start-up and keeps them
in the fingerprint of every file it saves.

Layout (llama.cpp ``state_seq_save_file`` and ``llama_kv_cache::state_write``): u32 magic,
u32 version, u32 n, then n int32 (the plain tokens or, when the first is -1,
server_tokens' packed form: u32 version, u32 count, the tokens). Then the memory: u32
n_stream, and per stream u32 cell_count; a stream with cells has its cells' metadata
(i32 pos, u32 n_seq_id, an optional 8-byte extension for M-RoPE models, n_seq_id i32
seq ids), then u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v, and per layer the K
type (i32), its row size (u64) and the rows; the V layers follow the same way.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

SLOT_FILE_MAGIC = 0x67677371  # 'ggsq', llama.cpp's LLAMA_STATE_SEQ_MAGIC
PACKED_MARKER = -1            # LLAMA_TOKEN_NULL: server_tokens' packed format follows
MAX_VALUES = 10_000_000       # more tokens than any context: not a slot file
CELL_EXTENSIONS = (0, 8)      # bytes of llama_kv_cell_ext after a cell's n_seq_id
# ggml_type ids of the cache types llama-server accepts for -ctk/-ctv.
GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0",
              20: "iq4_nl", 30: "bf16"}


def _head(handle: BinaryIO) -> list[int] | None:
    magic, _version, n_values = struct.unpack("<III", handle.read(12))
    if magic != SLOT_FILE_MAGIC or n_values > MAX_VALUES:
        return None
    raw = handle.read(4 * n_values)
    if len(raw) != 4 * n_values:
        return None
    return list(struct.unpack(f"<{n_values}i", raw))


def tokens(path: Path) -> list[int] | None:
    """The token ids at the head of a slot file, or None when unreadable."""
    try:
        with open(path, "rb") as handle:
            values = _head(handle)
    except (OSError, struct.error):
        return None
    if values is None or not values or values[0] != PACKED_MARKER:
        return values
    if len(values) < 3:
        return None
    count = values[2] & 0xFFFFFFFF
    found = values[3:3 + count]
    return found if len(found) == count else None


def _cells_end(meta: bytes, cell_count: int, extension: int) -> int | None:
    """Where the cells' metadata ends when each cell has ``extension`` extra bytes, or None
    when the bytes do not read as one sequence's cells (one seq id each, ascending pos)."""
    offset, last_pos = 0, -1
    for _ in range(cell_count):
        if offset + 8 + extension + 4 > len(meta):
            return None
        pos, n_seq = struct.unpack_from("<iI", meta, offset)
        if n_seq != 1 or pos < last_pos:
            return None
        last_pos = pos
        offset += 8 + extension + 4
    return offset


def _read(handle: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    raw = handle.read(size)
    if len(raw) != size:
        raise struct.error("short read")
    return struct.unpack(fmt, raw)


def kv_format(path: Path) -> str | None:
    """The KV cache layout a slot file was written with, as a short text such as
    ``k=f16 v=f16 v_trans=1 layers=30 rot=0,0``, with `` streams=N`` when the cache has one
    stream per slot (``-np N``: llama-server refuses a file of another stream count, "n_stream
    mismatch"); None when the file holds no cells or cannot be read (then nothing is claimed
    about it). Reads the headers only, seeking past the
    rows, so a file of gigabytes costs a few reads."""
    try:
        with open(path, "rb") as handle:
            if _head(handle) is None:
                return None
            n_stream, = _read(handle, "<I")
            for _ in range(min(n_stream, 4096)):
                cell_count, = _read(handle, "<I")
                if cell_count:
                    layout = _layout(handle, cell_count)
                    return f"{layout} streams={n_stream}" if layout and n_stream > 1 else layout
    except (OSError, struct.error):
        return None
    return None


def _layout(handle: BinaryIO, cell_count: int) -> str | None:
    start = handle.tell()
    meta = handle.read((12 + max(CELL_EXTENSIONS)) * cell_count + 16)
    for extension in CELL_EXTENSIONS:
        end = _cells_end(meta, cell_count, extension)
        if end is None or end + 16 > len(meta):
            continue
        v_trans, n_layer, n_rot_k, n_rot_v = struct.unpack_from("<IIII", meta, end)
        if v_trans > 1 or not 0 < n_layer < 10_000:
            continue
        handle.seek(start + end + 16)
        k_type = None
        for _ in range(n_layer):  # skip the K rows of every layer to reach the first V type
            layer_type, row = _read(handle, "<iQ")
            k_type = layer_type if k_type is None else k_type
            handle.seek(row * cell_count, 1)
        v_type, = _read(handle, "<i")
        return (f"k={GGML_TYPES.get(k_type, f'type{k_type}')} "
                f"v={GGML_TYPES.get(v_type, f'type{v_type}')} v_trans={v_trans} "
                f"layers={n_layer} rot={n_rot_k},{n_rot_v}")
    return None
