"""Proving that llama-server honours a restore, before any session relies on it.

A sliding-window model without ``--swa-full`` (and a hybrid or recurrent model on this
llama.cpp build) answers a restore with success and then recomputes the whole prompt.
The probe finds out with a short text of its own: prefill it, save, erase, restore, then
ask for one token and read ``timings.cache_n``. The probe file also tells the KV format
(``slot_file.kv_format``), which ``/props`` does not report. The slot is left empty: what the
probe leaves behind is a list of actions (``after_probe``) the switch's executor carries out.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvproxy.slots.plan import (OURS, MarkUnproven, NoteKvFormat, WriteRecord, fingerprint_key,
                                judge_slot)
from kvproxy.slots.restore_check import cause_of, judge
from kvproxy.slots.state import Phase, SlotState, emptied
from kvproxy.storage.store import PROBE_PREFIX, unlink_with_companions
from kvproxy.upstream import gguf, slot_file
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable

log = logging.getLogger("kvproxy.startup")

# Slots whose content kvproxy would not use anyway: the probe may fill and empty them.
SPARE = (Phase.EMPTY, Phase.CLAIMED, Phase.UNPROVEN)
# About 130 tokens on common tokenizers: above the restore check's 64-token floor, cheap
# to prefill on any model.
PROBE_TEXT = "kvproxy saves and restores llama-server slots; this text checks a restore. " * 9


@dataclass(frozen=True)
class ProbeVerdict:
    """What the probe measured. ``honoured`` is None when it could not finish."""

    honoured: bool | None
    restored: int = 0
    reused: int = 0
    kv_format: str | None = None
    detail: str = ""
    touched: bool = True   # the slot's content changed (False: stopped before the prefill)


def probe(client: LlamaClient, root: Path, slot: int) -> ProbeVerdict:
    """Prefill, save, erase, restore, then one token into ``slot`` (the caller holds it and
    nothing of value is in it). Never raises for llama-server's answers: a probe that
    cannot finish says why in ``detail``."""
    name = f"{PROBE_PREFIX}{secrets.token_hex(8)}.bin"
    path = Path(root) / name
    touched = False
    try:
        tokens = client.tokenize(PROBE_TEXT)
        touched = True
        client.prefill(tokens, slot)
        client.slot_action(slot, "save", name)
        kv_format = slot_file.kv_format(path)
        client.slot_action(slot, "erase")
        restored = int(client.slot_action(slot, "restore", name).get("n_restored") or 0)
        answer = client.post_json("/completion", {
            "prompt": tokens, "n_predict": 1, "cache_prompt": True, "id_slot": slot,
            "temperature": 0, "stream": False})
        reused = int((answer.get("timings") or {}).get("cache_n") or 0)
        client.slot_action(slot, "erase")
    except (UpstreamError, UpstreamUnavailable, KeyError, TypeError, ValueError) as exc:
        return ProbeVerdict(None, detail=f"the restore probe could not finish: {exc}",
                            touched=touched)
    finally:
        unlink_with_companions(path)   # and a newer llama-server's <file>.ckpt
    verdict = judge(restored, reused, max(0, len(tokens) - 1))
    honoured = None if verdict == "not_comparable" else verdict == "honoured"
    return ProbeVerdict(honoured, restored, reused, kv_format,
                        f"{reused} of {restored} restored tokens reused")


def spare_slot(switch, client: LlamaClient, table: dict) -> int | None:
    """A slot whose content kvproxy would not use: one the state table calls spare, else one
    that ``/slots`` shows no longer holds its recorded session (llama-server restarted)."""
    slots = switch.slot_ids()
    for slot in slots:
        if (table.get(slot) or SlotState()).phase in SPARE:
            return slot
    try:
        entries = {e.get("id"): e for e in client.slots() if isinstance(e, dict)}
    except (UpstreamError, UpstreamUnavailable, TypeError, AttributeError):
        return None
    for slot in slots:
        if judge_slot(entries.get(slot), (table.get(slot) or SlotState()).tokens) != OURS:
            return slot
    return None


def prove_restores(switch, client: LlamaClient) -> ProbeVerdict | None:
    """Probe in a slot that holds nothing kvproxy can use (the caller holds every slot),
    leave that slot empty in the state table, keep the KV format for the fingerprint and
    tell the restore check what was measured. None when every slot holds a session (a
    kvproxy restart in front of a running llama-server): the probe never costs one."""
    table = switch.table.read()
    slot = spare_slot(switch, client, table)
    if slot is None:
        log.info("restore probe skipped: every slot holds a session; restores are judged on "
                 "real requests")
        return None
    return probe_slot(switch, client, slot, table.get(slot) or SlotState())


def after_probe(slot: int, state: SlotState, verdict: ProbeVerdict) -> list:
    """What the probe leaves behind, as actions: a slot it stopped in half-way is trusted with
    nothing; a finished probe leaves it empty and tells the KV format it read."""
    if verdict.honoured is None:
        return [MarkUnproven(slot)] if verdict.touched else []
    return [WriteRecord(slot, emptied(state, False))] + \
        ([NoteKvFormat(verdict.kv_format)] if verdict.kv_format else [])


def probe_slot(switch, client: LlamaClient, slot: int, state: SlotState) -> ProbeVerdict:
    """Probe in ``slot`` (held by the caller, holding ``state``), leave it empty, and tell
    the fingerprint and the restore check what was measured."""
    verdict = probe(client, switch.store.root, slot)
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
