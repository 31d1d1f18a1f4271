"""Slot files written the way llama-server writes them (state version 4), for tests without it.

Each cell's rows are derived from the token prefix that ends there, as a real model's are:
two files that share a prefix share those rows byte for byte.
"""
from __future__ import annotations

import hashlib
import struct


def _row(tag: bytes, tokens: list[int], i: int, size: int) -> bytes:
    seed = hashlib.sha256(tag + struct.pack(f"<{i + 1}i", *tokens[:i + 1])).digest()
    return (seed * (size // len(seed) + 1))[:size]


def cache_section(tokens: list[int], *, n_layer: int = 2, k_row: int = 128, v_row: int = 128,
                  v_trans: int = 0, v_el: int = 2, n_stream: int = 1, stream: int = 0,
                  ext: int = 0, seq: int = 0, positions: list[int] | None = None,
                  seqs: list[int] | None = None, k_type: int = 1, tag: bytes = b"") -> bytes:
    """One cache's part of a slot file: streams, cells, then every layer's K and V."""
    n = len(tokens)
    out = [struct.pack("<I", n_stream)]
    for s in range(n_stream):
        if s != stream:
            out.append(struct.pack("<I", 0))
            continue
        out.append(struct.pack("<I", n))
        for i in range(n):
            pos = positions[i] if positions else i
            out.append(struct.pack("<iI", pos, 1) + b"\0" * ext
                       + struct.pack("<i", seqs[i] if seqs else seq))
        out.append(struct.pack("<IIII", v_trans, n_layer, 0, 0))
        for layer in range(n_layer):
            out.append(struct.pack("<iQ", k_type, k_row))
            out += [_row(tag + b"k%d" % layer, tokens, i, k_row) for i in range(n)]
        for layer in range(n_layer):
            if v_trans:
                n_embd = v_row // v_el
                out.append(struct.pack("<iII", 1, v_el, n_embd))
                cells = [_row(tag + b"v%d" % layer, tokens, i, v_row) for i in range(n)]
                for j in range(n_embd):   # row j: element j of every cell
                    out += [cell[j * v_el:(j + 1) * v_el] for cell in cells]
            else:
                out.append(struct.pack("<iQ", 1, v_row))
                out += [_row(tag + b"v%d" % layer, tokens, i, v_row) for i in range(n)]
    return b"".join(out)


def slot_file(tokens: list[int], *, version: int = 4, media: int = 0, sections: int = 1,
              rest: bytes = b"", **cache) -> bytes:
    """A whole slot file: header, packed tokens, ``sections`` caches, then ``rest``."""
    values = [-1, 1, len(tokens), *tokens, media]
    head = struct.pack("<III", 0x67677371, version, len(values)) + struct.pack(
        f"<{len(values)}i", *values)
    body = b"".join(cache_section(tokens, tag=b"s%d" % n, **cache) for n in range(sections))
    return head + body + rest


# -- a folder's save and restore without llama-server ------------------------------------
MADE_BY = {"model_path": "/m.gguf", "n_ctx": 4096, "build_info": "b1"}


def saver(data: bytes, folder):
    """llama-server's save of ``data`` under a name in ``folder`` (it follows a link there)."""
    def write(name):
        (folder / name).write_bytes(data)
        return {"n_saved": 1, "n_written": len(data)}
    return write


def describe(answer, size):
    return {"format": 3, "saved_at": "2026-12-06T00:00:00+00:00", "saved_bytes": size,
            "n_bytes": answer["n_written"], "made_by": MADE_BY, "session_id": "s",
            "kind": "session"}


def save(files, stem: str, data: bytes) -> dict:
    """Save ``data`` as ``stem`` through a store's ``SessionFiles`` (``storage.session_files``)."""
    return files.save(stem, saver(data, files.store.root),
                      lambda a, size: {**describe(a, size), "stem": stem})


def restored(files, stem: str) -> bytes:
    """The bytes llama-server would read restoring ``stem``."""
    with files.staged(stem) as name:
        return (files.store.root / name).read_bytes()
