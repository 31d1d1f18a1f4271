"""Pure decisions about the slot: what made a slot file, what /slots shows, what a swap must do.

No I/O here: the switch gathers the facts (its state file, a ``/slots``
entry) and carries out the plan, so the rules can be read and tested alone.
"""
from __future__ import annotations

from dataclasses import dataclass

# What /slots shows about the slot, against what kvproxy's last action left in it.
OURS, EMPTY, FOREIGN, UNKNOWN = "ours", "empty", "foreign", "unknown"
# The slot holds every token of the last answer but the last one sampled (never
# decoded), so /slots lists one fewer than the answer's timings add up to.
TOKEN_SLACK = 1


def judge_slot(entry: dict | None, expected: int) -> str:
    """What a ``/slots`` entry shows, against ``expected`` tokens that kvproxy left in the slot.

    ``n_prompt_tokens`` is the number of tokens the slot holds (llama.cpp
    ``server_slot::to_json``); it is listed only once the slot ran a task, so a
    freshly started llama-server shows none. Another client (llama-server's web
    UI, a direct request) leaves a different count.
    """
    if entry is None:
        return UNKNOWN
    held = int(entry.get("n_prompt_tokens") or 0) if "id_task" in entry else 0
    if held == 0:
        return OURS if expected == 0 else EMPTY
    return OURS if abs(held - expected) <= TOKEN_SLACK else FOREIGN


@dataclass(frozen=True)
class SwapPlan:
    hit: bool          # the slot already holds the session: nothing to do
    save_active: bool  # save the slot over the active session's file first
    keep_file: bool    # the active session has a file that must not be overwritten


def plan_swap(state: dict, session_key: str, view: str) -> SwapPlan:
    """Decide a swap from the state file and what the slot was seen to hold.

    Only a slot proven to hold the active session (``OURS``) is trusted: it
    serves the same session again as a hit, or is saved before a swap. Anything
    else (emptied, foreign, unknown) is never saved, and the session is loaded
    from its own file even when the state file says the slot holds it.
    """
    persistent_active = bool(state.get("active_persistent") and state.get("active"))
    if state.get("active_key") == session_key and view == OURS:
        return SwapPlan(hit=True, save_active=False, keep_file=False)
    return SwapPlan(hit=False, save_active=persistent_active and view == OURS,
                    keep_file=persistent_active and view != OURS)


def fingerprint(props: dict, models: dict) -> dict:
    """What made a slot file: a file from anything else must not be restored."""
    meta = {}
    for entry in models.get("data") or []:
        meta = entry.get("meta") or {}
        break
    settings = props.get("default_generation_settings") or {}
    return {
        "model_path": props.get("model_path"),
        "model_size": meta.get("size"),
        "n_params": meta.get("n_params"),
        "n_ctx": settings.get("n_ctx") or props.get("n_ctx"),
        "build_info": props.get("build_info"),
    }


def fingerprint_key(made_by: dict) -> str:
    return "|".join(f"{k}={made_by.get(k)}" for k in sorted(made_by))



def too_big(n_tokens: object, slot_n_ctx: int | None) -> str | None:
    """Why a file of ``n_tokens`` cannot be restored into a slot of ``slot_n_ctx``, or None.
    llama-server answers such a restore with an error and leaves the slot wiped. (The
    fingerprint's n_ctx already ties a file to one slot size: llama-server refused even a
    210-token file saved with -np 1 -c 4096 in a -np 2 -c 4096 slot. This guards what /slots
    shows of each slot against what /props reports.)"""
    if not isinstance(n_tokens, int) or not slot_n_ctx:
        return None
    if n_tokens > slot_n_ctx:
        return f"it holds {n_tokens} tokens, more than the {slot_n_ctx}-token context"
    return None


def save_before_side(entry: dict) -> bool:
    """Whether a slot's session must be saved before a side request llama-server may run in
    that slot: a persistent session whose newest turns its file lacks (``unsaved``), in a
    slot kvproxy can vouch for (an unproven slot is never saved over a file)."""
    return bool(entry.get("active") and entry.get("active_persistent") and entry.get("unsaved")
                and not entry.get("slot_unknown"))


def side_landed_in(table: dict[int, dict], listing, slots: list[int]) -> list[int]:
    """The ``slots`` whose ``/slots`` entry no longer shows what the state table says they
    hold: a side request llama-server did not pin ran there. Slots already unproven are
    left out (nothing there is trusted anyway); an answer that is not a list proves nothing."""
    entries = {e.get("id"): e for e in (listing if isinstance(listing, list) else [])
               if isinstance(e, dict)}
    changed = []
    for slot in slots:
        entry = table.get(slot) or {}
        if entry.get("slot_unknown"):
            continue
        if judge_slot(entries.get(slot), int(entry.get("slot_tokens") or 0)) != OURS:
            changed.append(slot)
    return changed
