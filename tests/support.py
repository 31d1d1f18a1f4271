"""Helpers the unit tests share: one copy each (fixtures live in conftest.py)."""
from __future__ import annotations

import struct
import time

from kvproxy.sessions.identity import Session
from kvproxy.slots.switch import SlotSwitch
from kvproxy.storage.store import SessionStore
from kvproxy.telemetry import metrics
from kvproxy.upstream.llama import LlamaClient
from kvproxy.upstream.slot_file import SLOT_FILE_MAGIC
from tests.fake_llama import MODEL, UPSTREAM

class Clock:
    """A clock a test moves by hand (``clock.now += ...``), for code that takes one."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# Two conversations behind two system prompts, and three without one (the multi-slot tests).
A = Session("A", "test", system_hash="aaaa", model=MODEL)
B = Session("B", "test", system_hash="bbbb", model=MODEL)
PLAIN_A = Session("A", "test", model=MODEL)
PLAIN_B = Session("B", "test", model=MODEL)
PLAIN_C = Session("C", "test", model=MODEL)


def metric(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def sample(families: dict, family: str, name: str | None = None, **labels: str) -> float:
    key = (name or family, tuple(sorted(labels.items())))
    return families.get(family, {}).get("samples", {}).get(key, 0.0)


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def error_shaped(api: str, body: dict) -> bool:
    if api == "openai":
        return isinstance(body.get("error"), dict) and "message" in body["error"]
    if api == "anthropic":
        return body.get("type") == "error" and "message" in body.get("error", {})
    return isinstance(body.get("error"), str)


def turn(switch, session, fake, tokens=12, prompt=None):
    """One request on the switch that leaves ``tokens`` in its slot."""
    lease = switch.acquire(session, prompt=prompt)
    fake.tokens = tokens
    switch.release(lease, {"cache_n": lease.restored_tokens, "prompt_n": tokens - lease.restored_tokens,
                           "predicted_n": 0})
    return lease


def timed_turn(switch, session, fake, timings=None):
    """One request: take the slot, 'generate', release with timings."""
    lease = switch.acquire(session)
    fake.tokens = (timings or fake.chat_timings)["cache_n"] + 12
    switch.release(lease, timings or {"cache_n": lease.restored_tokens, "prompt_n": 10,
                                      "predicted_n": 2})
    return lease


def switch_over(tmp_path, slots=0, **kwargs):
    """A switch as the app builds it: slot count 0 means 'ask llama-server'."""
    kwargs.setdefault("base_snapshots", False)
    # Not the shipped default: these tests count the stub's slot actions one by one, and a
    # background save would add its own when its delay runs out (test_save_behind.py tests it).
    kwargs.setdefault("save_behind", False)
    return SlotSwitch(LlamaClient(UPSTREAM), SessionStore(tmp_path), slots=slots, **kwargs)


def slot_file(path, *, cells=3, k_type=1, v_type=1, v_trans=0, layers=2, ext=0, rot=(0, 0),
              n_stream=1, empty_streams_first=0):
    """A file laid out as ``state_seq_save_file`` writes one sequence: header, tokens, then
    per stream the cells' metadata and each layer's K rows and V rows."""
    out = struct.pack("<III", SLOT_FILE_MAGIC, 1, cells) + struct.pack(f"<{cells}i", *range(cells))
    out += struct.pack("<I", n_stream + empty_streams_first)
    out += struct.pack("<I", 0) * empty_streams_first
    out += struct.pack("<I", cells)
    for pos in range(cells):
        out += struct.pack("<iI", pos, 1) + b"\0" * ext + struct.pack("<i", 0)
    out += struct.pack("<IIII", v_trans, layers, *rot)
    row = 16
    for _ in range(layers):
        out += struct.pack("<iQ", k_type, row) + b"k" * row * cells
    for _ in range(layers):
        if v_trans:
            out += struct.pack("<iII", v_type, 2, 8) + b"v" * 16 * cells
        else:
            out += struct.pack("<iQ", v_type, row) + b"v" * row * cells
    path.write_bytes(out)
    return path


SAVED_SUFFIXES = (".bin", ".chunked")   # a saved session's own file: whole, or its manifest


def stem_of(name: str) -> str:
    """The stem of a saved session's file name (``<stem>.bin`` or ``<stem>.chunked``)."""
    for suffix in SAVED_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def saved_stems(slot_dir) -> set[str]:
    """The stems of every saved session and base snapshot in a slot folder, however stored
    (temporary and assembled files left out)."""
    return {stem_of(p.name) for suffix in SAVED_SUFFIXES for p in slot_dir.glob(f"*{suffix}")
            if not p.name.endswith((".saving.bin", ".restoring.bin")) and not p.name.startswith(".")}


CHUNK_MADE_BY = {"model_path": "/m.gguf", "n_ctx": 4096, "build_info": "b1"}


def save_chunked(files, stem: str, tokens: list[int],
                 saved_at: str = "2026-12-06T00:00:00.000+00:00") -> dict:
    """Save a slot file of ``tokens`` (tests/slot_files.py) as ``stem`` through ``files`` (a
    ``ChunkedFiles``), as a swap's save does: it is packed into chunks and a manifest, and
    its sidecar keeps the fields of the one it replaces."""
    from tests.slot_files import slot_file
    data = slot_file(tokens)

    def write(name: str) -> dict:
        (files.store.root / name).write_bytes(data)
        return {"n_saved": len(tokens), "n_written": len(data)}

    def describe(answer: dict, size: int) -> dict:
        fields = {"format": 3, "saved_at": saved_at, "saved_bytes": size,
                  "n_bytes": answer["n_written"], "made_by": CHUNK_MADE_BY, "session_id": stem,
                  "kind": "session", "n_tokens": len(tokens)}
        return {**fields, "stem": stem}
    return files.save(stem, write, describe)
