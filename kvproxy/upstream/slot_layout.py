"""Where each token's KV lies in a llama-server slot file: the map the chunk store cuts along.

The file (llama.cpp ``state_seq_save_file``, ``llama_kv_cache::state_write``, state version 4):
u32 magic, u32 version, u32 n, n int32 (server_tokens' packed form ``[-1, 1, count,
tokens..., n_media, media...]``), then the memory: u32 n_stream and per stream u32
cell_count; the stream holding the sequence has its cells' metadata (i32 pos, u32 n_seq_id,
a 12-byte extension on M-RoPE and PLE models, the seq ids), then u32 v_trans, u32 n_layer,
u32 n_rot_k, u32 n_rot_v; per layer K: i32 type, u64 row size, one row per cell; per layer
V: the same when ``v_trans`` is 0, else i32 type, u32 element size, u32 n_embd_v_gqa and a
[n_embd_v_gqa x cells] matrix. A sliding-window model writes a second cache the same way;
it is cut too when it holds every token (``--swa-full``). What follows (the other streams, a
window's cells, a recurrent state) is not cut: it stays in the session's own tail.

``read_layout`` says where the rows of every layer start, but only for a file it fully
understands: version 4, no media, one stream with cells, cells at positions 0..n-1 in order,
one sequence, as many cells as tokens, known cache types. Anything else is None and the file
is kept whole: the chunk store never guesses.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvproxy.upstream.slot_file import GGML_TYPES, PACKED_MARKER, SLOT_FILE_MAGIC

STATE_VERSIONS = (4,)      # llama.cpp LLAMA_STATE_SEQ_VERSION values this map is known for
CELL_EXTENSIONS = (0, 12)  # llama_kv_cell_ext {x, y, tok}: written on M-RoPE and PLE models
MAX_LAYERS = 10_000


@dataclass(frozen=True)
class Layer:
    """One layer's rows: K always one row per cell; V one row per cell (``el`` 0) or, with
    ``v_trans``, ``n_embd`` rows of ``el``-byte elements, one element per cell."""

    k_at: int          # offset of the first K row
    k_row: int         # bytes per cell of K
    v_at: int          # offset of the first V row (or of the V matrix)
    v_row: int         # bytes per cell of V (with v_trans: el x n_embd)
    v_el: int = 0      # element bytes of the transposed V (0: not transposed)
    v_embd: int = 0    # rows of the transposed V


@dataclass(frozen=True)
class Section:
    """One cache's part of the file (a sliding-window model writes two): its literal head ends
    at ``data_at + 16``, then its layers' rows, up to ``end``."""

    data_at: int            # offset of v_trans, n_layer, n_rot_k, n_rot_v
    end: int
    layers: tuple[Layer, ...]


@dataclass(frozen=True)
class Layout:
    """A slot file llama-server wrote, mapped: its tokens and where every layer's rows are."""

    size: int               # the file's bytes
    tokens: tuple[int, ...]
    sections: tuple[Section, ...]
    format: str             # what must match for two files' rows to be interchangeable

    @property
    def cells(self) -> int:
        return len(self.tokens)

    @property
    def layers(self) -> tuple[Layer, ...]:
        return tuple(layer for section in self.sections for layer in section.layers)

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.k_row + layer.v_row for layer in self.layers)


def _unpack(buf, fmt: str, at: int) -> tuple:
    if at + struct.calcsize(fmt) > len(buf):
        raise ValueError("short file")
    return struct.unpack_from(fmt, buf, at)


def _tokens(buf) -> tuple[tuple[int, ...], int, int] | None:
    """The tokens of a version-4 file without media, the state version and where the memory starts."""
    magic, version, n_values = _unpack(buf, "<III", 0)
    if magic != SLOT_FILE_MAGIC or version not in STATE_VERSIONS or not 4 <= n_values < 10_000_000:
        return None
    if 12 + 4 * n_values > len(buf):
        raise ValueError("short file")
    values = np.frombuffer(buf, dtype="<i4", count=n_values, offset=12)
    count = int(values[2])
    if values[0] != PACKED_MARKER or values[1] != 1 or n_values != count + 4 or values[-1] != 0:
        return None   # the plain form, media, or a packing of another version
    return tuple(int(t) for t in values[3:3 + count]), version, 12 + 4 * n_values


def head_tokens(buf) -> tuple[int, ...] | None:
    """The tokens at the head of a slot file (or of a manifest's tail), None when not one the
    chunk store cuts."""
    try:
        head = _tokens(buf)
    except (ValueError, struct.error):
        return None
    return head[0] if head else None


def _cells_end(buf, at: int, count: int) -> tuple[int, int] | None:
    """Where the cells' metadata ends and the extension it has, when the cells are one sequence
    at positions 0..count-1 in order (what the chunk keys assume); else None."""
    for ext in CELL_EXTENSIONS:
        width = 12 + ext
        end = at + width * count
        if end + 16 > len(buf):
            continue
        cells = np.frombuffer(buf, dtype=np.uint8, count=width * count, offset=at).reshape(count, width)
        pos = cells[:, 0:4].copy().view("<i4").ravel()
        n_seq = cells[:, 4:8].copy().view("<u4").ravel()
        seq = cells[:, 8 + ext:12 + ext].copy().view("<i4").ravel()
        v_trans, n_layer = _unpack(buf, "<II", end)
        if (v_trans <= 1 and 0 < n_layer < MAX_LAYERS and np.array_equal(pos, np.arange(count))
                and (n_seq == 1).all() and (seq == seq[0]).all()):
            return end, ext
    return None


def read_layout(path: Path) -> Layout | None:
    """The map of a slot file, or None when it is not a file the chunk store can cut."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return layout_of(buf)
    except (OSError, ValueError, struct.error):
        return None


def layout_of(buf) -> Layout | None:
    """``read_layout`` over bytes in memory (or a map of the file)."""
    try:
        return _layout(buf)
    except (ValueError, struct.error):
        return None


def _layout(buf) -> Layout | None:
    head = _tokens(buf)
    if head is None:
        return None
    tokens, version, at = head
    sections, shapes = [], []
    while True:  # a sliding-window model's second cache is cut too when it holds every cell
        try:
            found = _section(buf, at, len(tokens))
        except (ValueError, struct.error):
            if not sections:
                raise
            found = None   # what follows the first cache is not one: it stays whole
        if found is None:
            break
        section, shape = found
        sections.append(section)
        shapes.append(shape)
        at = section.end
    if not sections:
        return None
    described = json.dumps({"state": version, "sections": shapes}, separators=(",", ":"))
    return Layout(size=len(buf), tokens=tokens, sections=tuple(sections),
                  format=hashlib.sha256(described.encode()).hexdigest()[:32])


def _section(buf, at: int, cells: int) -> tuple[Section, dict] | None:
    """The cache section at ``at`` when it holds exactly the file's tokens, one stream."""
    if at + 4 > len(buf):
        return None
    n_stream, = _unpack(buf, "<I", at)
    at += 4
    cells_at = None
    for _ in range(min(n_stream, 4096)):
        cell_count, = _unpack(buf, "<I", at)
        at += 4
        if not cell_count:
            continue
        if cell_count != cells:
            return None
        cells_at = at
        break
    if cells_at is None:
        return None
    found = _cells_end(buf, cells_at, cells)
    if found is None:
        return None
    data_at, ext = found
    v_trans, n_layer, n_rot_k, n_rot_v = _unpack(buf, "<IIII", data_at)
    at = data_at + 16
    keys = []
    for _ in range(n_layer):
        k_type, k_row = _unpack(buf, "<iQ", at)
        if k_type not in GGML_TYPES or not 0 < k_row < 1 << 24:
            return None
        keys.append((k_type, k_row, at + 12))
        at += 12 + k_row * cells
    layers, shape = [], []
    for k_type, k_row, k_at in keys:
        if v_trans:
            v_type, v_el, v_embd = _unpack(buf, "<iII", at)
            if v_type not in GGML_TYPES or not 0 < v_el <= 8 or not 0 < v_embd < 1 << 20:
                return None
            layers.append(Layer(k_at, k_row, at + 12, v_el * v_embd, v_el, v_embd))
            shape.append((k_type, k_row, v_type, v_el, v_embd))
            at += 12 + v_el * v_embd * cells
        else:
            v_type, v_row = _unpack(buf, "<iQ", at)
            if v_type not in GGML_TYPES or not 0 < v_row < 1 << 24:
                return None
            layers.append(Layer(k_at, k_row, at + 12, v_row))
            shape.append((k_type, k_row, v_type, v_row))
            at += 12 + v_row * cells
    if at > len(buf):
        return None
    return (Section(data_at, at, tuple(layers)),
            {"streams": n_stream, "ext": ext, "v_trans": v_trans, "rot": [n_rot_k, n_rot_v],
             "layers": shape})


def layout_record(layout: Layout) -> dict:
    """The map as plain data (the manifest keeps it, without the tokens)."""
    return {"size": layout.size, "format": layout.format,
            "sections": [{"data_at": s.data_at, "end": s.end,
                          "layers": [list(asdict(layer).values()) for layer in s.layers]}
                         for s in layout.sections]}


def layout_from_record(record: dict, tokens: tuple[int, ...]) -> Layout:
    """``layout_record`` read back (``ValueError`` when it is not one)."""
    try:
        sections = tuple(Section(int(s["data_at"]), int(s["end"]),
                                 tuple(Layer(*(int(v) for v in row)) for row in s["layers"]))
                         for s in record["sections"])
        return Layout(size=int(record["size"]), tokens=tuple(tokens), sections=sections,
                      format=str(record["format"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a slot file map: {exc}") from None
