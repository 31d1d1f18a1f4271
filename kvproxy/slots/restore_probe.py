"""Proving that llama-server honours a restore, before any session relies on it.

A sliding-window model without ``--swa-full`` (and a hybrid or recurrent model on this
llama.cpp build) answers a restore with success and then recomputes the whole prompt.
The probe finds out with a short text of its own: prefill it, save, erase, restore, then
ask for one token and read ``timings.cache_n``. The probe file also tells the KV format
(``slot_file.kv_format``), which ``/props`` does not report.

Decisions only. ``probe`` and ``spare_slot`` yield the steps they need, as actions, and are
sent the answers, as mitmproxy's layers yield commands and are sent their replies: the
switch's executor performs each step (``SlotExecutor.run``) and throws a failed one back in.
What the probe leaves behind is a list of actions too (``after_probe``): the slot is left
empty.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Generator, Union

from kvproxy.slots.plan import (OURS, MarkUnproven, NoteKvFormat, WriteRecord, fingerprint_key,
                                judge_slot)
from kvproxy.slots.restore_check import cause_of, judge
from kvproxy.slots.state import Phase, SlotState, emptied
from kvproxy.storage.store import PROBE_PREFIX
from kvproxy.upstream import gguf
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable

log = logging.getLogger("kvproxy.startup")

# Slots whose content kvproxy would not use anyway: the probe may fill and empty them.
SPARE = (Phase.EMPTY, Phase.CLAIMED, Phase.UNPROVEN)
# About 130 tokens on common tokenizers: above the restore check's 64-token floor, cheap
# to prefill on any model.
PROBE_TEXT = "kvproxy saves and restores llama-server slots; this text checks a restore. " * 9
# What stops a probe half-way: llama-server's failures, and answers that are not what it
# sends. Anything else is a bug, and goes up (the probe file removed first).
PROBE_FAILURES = (UpstreamError, UpstreamUnavailable, KeyError, TypeError, ValueError)


# -- the steps, which the executor performs and answers ------------------------------------
@dataclass(frozen=True)
class ListSlots:
    """Ask ``/slots``; answered with llama-server's listing."""


@dataclass(frozen=True)
class Tokenize:
    """Ask llama-server for the tokens of ``text``; answered with them."""
    text: str


@dataclass(frozen=True)
class PrefillTokens:
    """Compute ``tokens`` into ``slot`` without generating; answered with llama-server's answer."""
    slot: int
    tokens: list[int]


@dataclass(frozen=True)
class SlotCall:
    """llama-server's slot ``action``: save into ``name`` (a file of its folder), erase, or
    restore from ``name``; answered with its answer."""
    slot: int
    action: str
    name: str | None = None


@dataclass(frozen=True)
class Completion:
    """POST ``body`` to ``/completion``; answered with llama-server's whole answer."""
    body: dict


@dataclass(frozen=True)
class ReadKvFormat:
    """The KV format of the slot file ``name`` in the slot folder (``slot_file.kv_format``)."""
    name: str


@dataclass(frozen=True)
class RemoveFile:
    """Delete the slot file ``name`` in the slot folder, with its companions (a newer
    llama-server's ``<file>.ckpt``)."""
    name: str


Step = Union[ListSlots, Tokenize, PrefillTokens, SlotCall, Completion, ReadKvFormat, RemoveFile]
Steps = Generator[Step, object, object]


@dataclass(frozen=True)
class ProbeVerdict:
    """What the probe measured. ``honoured`` is None when it could not finish."""

    honoured: bool | None
    restored: int = 0
    reused: int = 0
    kv_format: str | None = None
    detail: str = ""
    touched: bool = True   # the slot's content changed (False: stopped before the prefill)


def probe_name() -> str:
    """A probe file's name of its own: ``probe.<hex>.bin`` (the start-up sweep's leftover)."""
    return f"{PROBE_PREFIX}{secrets.token_hex(8)}.bin"


def one_token(tokens: list[int], slot: int) -> dict:
    """The request after the restore: one token after the probe text, its prompt cached."""
    return {"prompt": tokens, "n_predict": 1, "cache_prompt": True, "id_slot": slot,
            "temperature": 0, "stream": False}


def probe(slot: int, name: str) -> Generator[Step, object, ProbeVerdict]:
    """The steps of the probe in ``slot`` (the caller holds it and nothing of value is in
    it): prefill, save as ``name``, erase, restore, one token, erase; the probe file is
    removed whatever happens. Never fails for llama-server's answers: a probe that cannot
    finish says why in ``detail``."""
    touched = False
    try:
        tokens = yield Tokenize(PROBE_TEXT)
        touched = True
        yield PrefillTokens(slot, tokens)
        yield SlotCall(slot, "save", name)
        kv_format = yield ReadKvFormat(name)
        yield SlotCall(slot, "erase")
        restored = int((yield SlotCall(slot, "restore", name)).get("n_restored") or 0)
        answer = yield Completion(one_token(tokens, slot))
        reused = int((answer.get("timings") or {}).get("cache_n") or 0)
        yield SlotCall(slot, "erase")
    except PROBE_FAILURES as exc:
        return ProbeVerdict(None, detail=f"the restore probe could not finish: {exc}",
                            touched=touched)
    finally:
        yield RemoveFile(name)   # the executor finishes every run: this step always comes
    verdict = judge(restored, reused, max(0, len(tokens) - 1))
    honoured = None if verdict == "not_comparable" else verdict == "honoured"
    return ProbeVerdict(honoured, restored, reused, kv_format,
                        f"{reused} of {restored} restored tokens reused")


def spare_slot(slots: list[int], table: dict) -> Generator[Step, object, int | None]:
    """A slot of ``slots`` whose content kvproxy would not use: one the state table calls
    spare, else one that ``/slots`` shows no longer holds its recorded session (llama-server
    restarted)."""
    for slot in slots:
        if (table.get(slot) or SlotState()).phase in SPARE:
            return slot
    try:
        entries = {e.get("id"): e for e in (yield ListSlots()) if isinstance(e, dict)}
    except (UpstreamError, UpstreamUnavailable, TypeError, AttributeError):
        return None
    for slot in slots:
        if judge_slot(entries.get(slot), (table.get(slot) or SlotState()).tokens) != OURS:
            return slot
    return None


def after_probe(slot: int, state: SlotState, verdict: ProbeVerdict) -> list:
    """What the probe leaves behind, as actions: a slot it stopped in half-way is trusted with
    nothing; a finished probe leaves it empty and tells the KV format it read."""
    if verdict.honoured is None:
        return [MarkUnproven(slot)] if verdict.touched else []
    return [WriteRecord(slot, emptied(state, False))] + \
        ([NoteKvFormat(verdict.kv_format)] if verdict.kv_format else [])


# -- run by the switch ------------------------------------------------------------------------
def prove_restores(switch, client: LlamaClient) -> ProbeVerdict | None:
    """Probe in a slot that holds nothing kvproxy can use (the caller holds every slot),
    leave that slot empty in the state table, keep the KV format for the fingerprint and
    tell the restore check what was measured. None when every slot holds a session (a
    kvproxy restart in front of a running llama-server): the probe never costs one. Its
    steps go to llama-server through ``client`` (the start-up check's own)."""
    table = switch.table.read()
    slot = switch.executor.run(spare_slot(switch.slot_ids(), table), client)
    if slot is None:
        log.info("restore probe skipped: every slot holds a session; restores are judged on "
                 "real requests")
        return None
    return probe_slot(switch, client, slot, table.get(slot) or SlotState())


def probe_slot(switch, client: LlamaClient, slot: int, state: SlotState) -> ProbeVerdict:
    """Probe in ``slot`` (held by the caller, holding ``state``) through ``client``, leave it
    empty, and tell the fingerprint and the restore check what was measured."""
    verdict = switch.executor.run(probe(slot, probe_name()), client)
    switch.executor.carry_out(after_probe(slot, state, verdict))
    if verdict.honoured is None:
        log.warning("%s; restores are judged on real requests instead", verdict.detail)
        return verdict
    made_by = switch.current_made_by()  # with the KV format just read
    cause = "" if verdict.honoured else cause_of(gguf.file_facts(made_by.get("model_path"))[0]
                                                 if made_by.get("model_path") else {})
    switch.restore_check.measured(fingerprint_key(made_by), verdict.honoured, cause)
    if verdict.honoured:
        log.info("restore probe passed: %s (KV format %s)", verdict.detail,
                 verdict.kv_format or "unknown")
    else:
        log.error("restore probe failed: llama-server reported the restore but %s: %s; "
                  "restoring is off, sessions stay apart and are computed afresh",
                  verdict.detail, cause)
    return verdict
