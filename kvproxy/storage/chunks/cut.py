"""Cutting a slot file into token-range chunks and its own tail, and putting it back together.

A chunk holds the KV of ``chunk_tokens`` consecutive tokens: every layer's K rows of those
cells, then every layer's V rows (with a transposed V, the [n_embd x tokens] block of each
layer). Its key chains the token prefix: ``sha256(previous key + the chunk's tokens)``, from
a seed of the model and the KV layout, so one key means one prefix of one model in one
format, wherever and whenever it was computed (keys by tokens, never by bytes). The tail is
the rest of the file in file order: the header and token list, the cells' metadata, the
layers' headers, the rows of the tokens after the last whole chunk, and what follows the
cut stream. ``assemble`` writes exactly the bytes ``cut`` read, one layer at a time.
"""
from __future__ import annotations

import hashlib
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np

from kvproxy.upstream.slot_layout import Layer, Layout, Section

HEADER = 12   # bytes of a layer's K or V header in the file


def seed(made_by: dict, layout_format: str) -> str:
    """The first link of every key: the model, the server and the KV layout (not the context
    size, which changes no row)."""
    facts = "|".join(f"{k}={made_by.get(k)}" for k in sorted(made_by) if k != "n_ctx")
    return hashlib.sha256(f"{facts}|layout={layout_format}".encode()).hexdigest()


def chunk_keys(first: str, tokens: Sequence[int], chunk_tokens: int) -> list[str]:
    """The keys of the whole chunks of ``tokens``, each chained to the one before."""
    keys, key = [], first
    data = np.asarray(tokens, dtype="<i4")
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        key = hashlib.sha256(key.encode() + data[start:start + chunk_tokens].tobytes()).hexdigest()
        keys.append(key)
    return keys


def chunk_bytes(layout: Layout, chunk_tokens: int) -> int:
    """The size of every chunk of this layout."""
    return layout.bytes_per_token * chunk_tokens


def _v_matrix(buf, layer: Layer, cells: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8, count=layer.v_embd * layer.v_el * cells,
                         offset=layer.v_at).reshape(layer.v_embd, layer.v_el * cells)


def chunk_parts(buf, layout: Layout, start: int, stop: int) -> list:
    """The pieces of the chunk of cells ``[start, stop)``, in chunk order (per section, K
    then V)."""
    view, parts = memoryview(buf), []
    for section in layout.sections:
        parts += [view[layer.k_at + start * layer.k_row:layer.k_at + stop * layer.k_row]
                  for layer in section.layers]
        for layer in section.layers:
            if layer.v_el:
                block = _v_matrix(buf, layer, layout.cells)[:, start * layer.v_el:stop * layer.v_el]
                parts.append(np.ascontiguousarray(block).reshape(-1).data)
            else:
                parts.append(view[layer.v_at + start * layer.v_row:layer.v_at + stop * layer.v_row])
    return parts


def tail_parts(buf, layout: Layout, whole: int) -> list:
    """The file's bytes no chunk holds, in file order; ``whole`` tokens are in chunks."""
    view, cells, at = memoryview(buf), layout.cells, 0
    parts = []
    for section in layout.sections:
        parts.append(view[at:section.data_at + 16])
        for layer in section.layers:
            parts += [view[layer.k_at - HEADER:layer.k_at],
                      view[layer.k_at + whole * layer.k_row:layer.k_at + cells * layer.k_row]]
        for layer in section.layers:
            parts.append(view[layer.v_at - HEADER:layer.v_at])
            if layer.v_el:
                rows = _v_matrix(buf, layer, cells)[:, whole * layer.v_el:]
                parts.append(np.ascontiguousarray(rows).reshape(-1).data)
            else:
                parts.append(view[layer.v_at + whole * layer.v_row:layer.v_at + cells * layer.v_row])
        at = section.end
    parts.append(view[at:])
    return parts


def assemble(layout: Layout, tail: bytes | memoryview, chunk: Callable[[int], bytes],
             n_chunks: int, chunk_tokens: int, out: BinaryIO) -> None:
    """Write the slot file of ``layout`` to ``out`` from its tail and its first ``n_chunks``
    chunks (``chunk(i)``: the bytes of chunk i, read once each), one layer at a time."""
    chunks = [memoryview(chunk(i)) for i in range(n_chunks)]
    if any(len(c) != chunk_bytes(layout, chunk_tokens) for c in chunks):
        raise ValueError("a chunk has the wrong size")
    Assembly(layout, memoryview(tail), chunks, chunk_tokens, out).write()


class Assembly:
    """``assemble``'s walk: the tail read in order, each chunk's pieces in order."""

    def __init__(self, layout: Layout, tail: memoryview, chunks: list[memoryview],
                 chunk_tokens: int, out: BinaryIO):
        self.layout, self.tail, self.chunks, self.out = layout, tail, chunks, out
        self.chunk_tokens = chunk_tokens
        self.whole = len(chunks) * chunk_tokens
        self.rest = layout.cells - self.whole
        self.at = 0       # read position in the tail
        self.offset = 0   # of the current piece inside every chunk

    def take(self, n: int) -> memoryview:
        piece = self.tail[self.at:self.at + n]
        if len(piece) != n:
            raise ValueError("the tail is short")
        self.at += n
        return piece

    def rows(self, row: int) -> None:
        """One layer's rows, one per cell: the chunks' pieces, then the tail's."""
        size = row * self.chunk_tokens
        for c in self.chunks:
            self.out.write(c[self.offset:self.offset + size])
        self.offset += size
        self.out.write(self.take(row * self.rest))

    def matrix(self, layer: Layer) -> None:
        """A transposed V layer: each chunk's [n_embd x tokens] block put back column-wise."""
        cells, width = self.layout.cells, layer.v_el * self.chunk_tokens
        matrix = np.empty((layer.v_embd, layer.v_el * cells), dtype=np.uint8)
        size = layer.v_row * self.chunk_tokens
        for i, c in enumerate(self.chunks):
            matrix[:, i * width:(i + 1) * width] = np.frombuffer(
                c[self.offset:self.offset + size], dtype=np.uint8).reshape(layer.v_embd, width)
        self.offset += size
        if self.rest:
            matrix[:, self.whole * layer.v_el:] = np.frombuffer(
                self.take(layer.v_row * self.rest), dtype=np.uint8).reshape(
                layer.v_embd, layer.v_el * self.rest)
        self.out.write(matrix.reshape(-1).data)

    def write(self) -> None:
        for section in self.layout.sections:
            self.out.write(self.take(section.data_at + 16 - self.layout_at(section)))
            for layer in section.layers:
                self.out.write(self.take(HEADER))
                self.rows(layer.k_row)
            for layer in section.layers:
                self.out.write(self.take(HEADER))
                if layer.v_el:
                    self.matrix(layer)
                else:
                    self.rows(layer.v_row)
        self.out.write(self.tail[self.at:])

    def layout_at(self, section: Section) -> int:
        """Where in the file the literal run before ``section``'s data header starts."""
        index = self.layout.sections.index(section)
        return 0 if index == 0 else self.layout.sections[index - 1].end


def joined(parts: list) -> Iterator[memoryview]:
    """The pieces as memoryviews (to write or hash one after another)."""
    for part in parts:
        yield memoryview(part)
