"""Pure decisions about a slot: what ``/slots`` shows, what a swap must do, what an answer changed.

No I/O here. The switch gathers the facts (the typed slot state, a ``/slots``
entry, the sidecars of the files a swap may restore) into ``SwapFacts``;
``plan_swap`` answers with the list of actions the swap needs, and the
executor (``slots.executor``) carries them out, as mitmproxy's layers yield
commands that only the server performs. So every rule can be read and tested
from facts alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from kvproxy.sessions.identity import MODEL_SEPARATOR, Session, base_stem, model_tag, owns
from kvproxy.slots.state import Phase, SlotState

# What /slots shows about the slot, against what kvproxy's last action left in it.
OURS, EMPTY, FOREIGN, UNKNOWN = "ours", "empty", "foreign", "unknown"
# /slots was not asked: nothing the swap does depends on it (``swap_needs_view``).
UNASKED = "unasked"
# The slot holds every token of the last answer but the last one sampled (never
# decoded), so /slots lists one fewer than the answer's timings add up to.
TOKEN_SLACK = 1
# Cache states reported to clients in X-KVProxy-Cache.
HIT, RESTORED, BASE, MISS = "hit", "restored", "base", "miss"
# Seconds between writes of a slot's last use alone to the state file (see after_answer).
USED_AT_RESOLUTION_S = 1.0
# A system prompt shorter than this is not worth a snapshot of its own.
MIN_BASE_TOKENS = 32
# llama-server's answer to a restore of a file it cannot take (another KV format, layers).
REFUSED_STATUS = 400


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


def saved_as_recorded(n_saved: object, expected: int) -> bool:
    """Whether a save llama-server reports holds the ``expected`` tokens kvproxy recorded in
    the slot. Its ``n_saved`` is the count ``/slots`` lists (the slot's cached tokens), so
    the same slack applies. A save that differs caught something else in the slot (a task
    llama-server placed there itself, another client): it must never become a file."""
    return isinstance(n_saved, int) and abs(n_saved - expected) <= TOKEN_SLACK


def view_without_asking(state: SlotState, uncertain: bool, open_since: bool) -> str | None:
    """What the slot holds when that is known without asking ``/slots``; None: ask.

    A slot being filled, unproven, or whose swap failed in this process is never
    trusted. ``open_since``: the caller trusts the connection (only the no-swap
    path does) and it is still open since kvproxy last recorded the slot, so
    llama-server did not restart. It cannot see a client that talked to
    llama-server directly, but the worst outcome there is one prefill; a swap
    that may save asks (``swap_needs_view``), because an uncertain slot must never
    be saved over a file.
    """
    if uncertain or state.phase in (Phase.CLAIMED, Phase.UNPROVEN):
        return UNKNOWN
    if open_since and state.tokens > 0:
        return OURS
    return None


def swap_needs_view(state: SlotState, session: Session, restoring_off: bool) -> bool:
    """Whether a swap's plan depends on what ``/slots`` shows of the slot: only to save turns
    the outgoing session's file lacks (never over a file without proof), to take over a
    fork's seed in place, or to notice an emptied slot while restoring is off. A slot whose
    session was saved behind is overwritten by the restore whatever it holds: one round trip
    less on the swap."""
    return worth_saving(state) or restoring_off or \
        bool(session.seed and state.key == session.seed)


def is_hit(state: SlotState, key: str, view: str) -> bool:
    """The slot provably holds the session already: nothing to do."""
    return state.key == key and view == OURS


# -- the facts of a swap and its actions ------------------------------------------------
@dataclass(frozen=True)
class FileFacts:
    """A slot file a swap may restore, as the slot folder shows it."""

    stem: str
    on_disk: bool = False
    sidecar: dict | None = None
    size_problem: str | None = None  # the file does not match its sidecar (``storage.quarantine``)
    fetched_ms: float | None = None  # brought from the shared store just now, in this long


@dataclass(frozen=True)
class SwapFacts:
    """Everything a swap of ``slot`` to ``session`` is decided on."""

    slot: int
    state: SlotState
    session: Session
    view: str                      # what /slots showed of the slot (OURS, EMPTY, ...)
    made_by: dict                  # the running llama-server's fingerprint
    restoring_off: bool = False    # restore_check switched restoring off for it
    own: FileFacts | None = None   # the session's own file
    base: FileFacts | None = None  # the base snapshot of its system prompt
    n_ctx: int | None = None       # the slot's context, from /slots
    base_snapshots: bool = True    # KVPROXY_BASE_SNAPSHOTS
    has_prompt: bool = False       # the request's prompt can be tokenized (a base can be made)
    seed: FileFacts | None = None  # a forked session's: the file of the one it forked from
    # A new session's: the stored session of its user holding the longest start of its prompt
    prefix: FileFacts | None = None


@dataclass(frozen=True)
class Save:
    """Save the slot over the file of the session it provably holds."""
    slot: int
    state: SlotState


@dataclass(frozen=True)
class KeepFile:
    """The slot's session is not saved: not provably there (``view``), or restoring is off
    and a file would never be restored (``restoring_off``). Its file stays as it was."""
    slot: int
    state: SlotState
    view: str
    restoring_off: bool = False


@dataclass(frozen=True)
class Claim:
    """Name the session as what the slot is being filled with, unless another slot has it."""
    slot: int
    session: Session


@dataclass(frozen=True)
class Refuse:
    """A file that is not restored: why, the metric it counts as, what to do with the file."""
    stem: str
    reason: str
    metric: str | None = None     # RESTORE_MISSES label
    quarantine: bool = False      # move it aside (it does not match its sidecar)
    record: bool = False          # write the reason into its sidecar (``refused``)
    saved_at: str | None = field(default=None, compare=False)  # the save refused, not a newer one


@dataclass(frozen=True)
class Restore:
    slot: int
    stem: str
    cache: str                    # RESTORED or BASE
    saved_at: str | None = field(default=None, compare=False)  # the save it restores


@dataclass(frozen=True)
class Erase:
    slot: int


@dataclass(frozen=True)
class MakeBase:
    """Prefill the system prompt alone and save it as the base snapshot (of ``model``)."""
    slot: int
    system_hash: str
    model: str | None = None


@dataclass(frozen=True)
class Adopt:
    """A fork's slot holds the conversation it was forked from (``stem``, ``tokens``):
    llama-server reuses the shared start as it is, nothing is restored."""
    slot: int
    stem: str
    tokens: int


@dataclass(frozen=True)
class Record:
    """The slot holds the session now, with what the filling left in it."""
    slot: int
    session: Session


@dataclass(frozen=True)
class MarkUnproven:
    """Trust nothing the slot holds until its next good swap (memory and state file)."""
    slot: int


@dataclass(frozen=True)
class WriteRecord:
    """Write the slot's record into the state table; ``answered``: the bookkeeping after an
    answer, which also writes the swap's record and the slot's last use."""
    slot: int
    state: SlotState
    answered: bool = False


@dataclass(frozen=True)
class NoteKvFormat:
    """The KV format llama-server writes, read from a file it saved (the restore probe's)."""
    kv_format: str


Action = Union[Save, KeepFile, Claim, Refuse, Restore, Erase, MakeBase, Adopt, Record,
               MarkUnproven, WriteRecord, NoteKvFormat]
# The actions that fill the slot: the first Restore that succeeds ends them.
FILLING = (Refuse, Restore, Erase, MakeBase)


def restore_problem(file: FileFacts, made_by: dict, n_ctx: int | None, slot: int) -> Refuse | None:
    """Why ``file`` may not be restored into this llama-server's ``slot``, or None.

    A file is restored only when its sidecar says this llama-server made it
    (same model, build and slot size), it matches its sidecar and it fits.
    """
    if not file.on_disk:
        return Refuse(file.stem, "it does not exist")
    sidecar = file.sidecar
    if not sidecar or not sidecar.get("saved_at"):
        return Refuse(file.stem, "it has no sidecar saying what made it")
    if file.size_problem:
        return Refuse(file.stem, file.size_problem, "bad_file", quarantine=True)
    if not same_maker(sidecar.get("made_by"), made_by):
        return Refuse(file.stem, f"made by {sidecar.get('made_by')}, running {made_by}",
                      "model_mismatch", record=True, saved_at=sidecar["saved_at"])
    if sidecar.get("refused_by") and same_maker(sidecar["refused_by"], made_by):
        return Refuse(file.stem, f"llama-server refused it before: {sidecar.get('refused')}",
                      "refused")
    problem = too_big(sidecar.get("n_tokens"), n_ctx)
    if problem:
        return Refuse(file.stem, f"{problem} of slot {slot}", "too_big", record=True,
                      saved_at=sidecar["saved_at"])
    return None


def candidates(facts: SwapFacts) -> list[tuple[FileFacts, str]]:
    """The files to try, in order: the session's own, the file it was forked from (its
    ``seed``: restored, never saved over, the slot is then this session's), the stored
    session of its user holding the longest start of its prompt (``prefix``, the same way),
    then its system prompt's base."""
    if not facts.session.persistent or facts.restoring_off:
        return []
    found = [(facts.own, RESTORED)] if facts.own else []
    if facts.seed:  # a fork starts from the conversation it shares its start with
        found.append((facts.seed, RESTORED))
    if facts.prefix:
        found.append((facts.prefix, RESTORED))
    if facts.base_snapshots and facts.session.system_hash and facts.base:
        found.append((facts.base, BASE))
    return found


def looks_for_prefix(session: Session, own: FileFacts | None, restoring_off: bool,
                     has_prompt: bool) -> bool:
    """Whether a swap looks for a stored session holding the start of the prompt: only for a
    persistent session with no file of its own and no seed, while restoring is on."""
    return bool(session.persistent and has_prompt and not restoring_off and not session.seed
                and not (own and own.on_disk))


def may_seed_from(session: Session, stem: str) -> bool:
    """Whether ``session`` may start from the stored file ``stem``: another file of the same
    model and, with API keys, of the same user (no cached-token count ever confirms another
    user's text)."""
    if stem == session.stem or model_tag_of(stem) != session.model:
        return False
    return owns(session.owner, stem) if session.owner else True


def model_tag_of(stem: str) -> str | None:
    return stem.rpartition(MODEL_SEPARATOR)[2] if MODEL_SEPARATOR in stem else None


def prefix_beats_base(prefix_tokens: int, base: FileFacts | None) -> bool:
    """A stored session is worth restoring over the base snapshot only when it holds more of
    the prompt than the snapshot's system prompt."""
    base_tokens = (base.sidecar or {}).get("n_tokens") if base and base.on_disk else 0
    return prefix_tokens > (base_tokens if isinstance(base_tokens, int) else 0)


def holds_seed(facts: SwapFacts) -> bool:
    """A fork whose slot provably holds the conversation it was forked from (saved first
    when it has turns its file lacks): the slot is taken over as it is."""
    state, session = facts.state, facts.session
    return bool(session.seed and session.persistent and state.key == session.seed
                and facts.view == OURS and state.trusted and state.tokens > 0
                and state.stem)


def wants_base(facts: SwapFacts) -> bool:
    """Make a base snapshot when the system prompt has none this llama-server made."""
    session = facts.session
    if not (facts.has_prompt and not facts.restoring_off and facts.base_snapshots
            and session.persistent and session.system_hash):
        return False
    base = facts.base
    return not (base and base.on_disk and base.sidecar
                and same_maker(base.sidecar.get("made_by"), facts.made_by)
                and not base.sidecar.get("refused_by"))


def plan_swap(facts: SwapFacts) -> list[Action]:
    """The actions that swap ``facts.slot`` to ``facts.session`` (not a hit).

    Only a slot proven to hold its session (``OURS``) with turns its file lacks
    (``UNSAVED``) is saved first; one whose file has them already is not; anything
    else (emptied, foreign, unknown) is never saved over a file, and nothing is
    saved while restoring is off (no disk for files never restored). Then the
    slot is claimed and filled: each candidate file is restored or refused in
    order, the first restore that succeeds ending the filling; else the slot is
    erased, and a new system prompt gets its base snapshot. ``Record`` ends it.
    """
    state, slot = facts.state, facts.slot
    actions: list[Action] = []
    if state.keeps_file and state.phase is not Phase.OURS:
        actions.append(save_or_keep(slot, state, facts.view, facts.restoring_off))
    actions.append(Claim(slot, facts.session))
    if holds_seed(facts):
        return actions + [Adopt(slot, state.stem, state.tokens), Record(slot, facts.session)]
    for file, cache in candidates(facts):
        refused = restore_problem(file, facts.made_by, facts.n_ctx, slot)
        if refused is None:
            actions.append(Restore(slot, file.stem, cache, (file.sidecar or {}).get("saved_at")))
        elif file.on_disk:
            actions.append(refused)
    actions.append(Erase(slot))
    if wants_base(facts):
        actions.append(MakeBase(slot, facts.session.base_hash, facts.session.model))
    actions.append(Record(slot, facts.session))
    return actions


def save_or_keep(slot: int, state: SlotState, view: str, restoring_off: bool = False,
                 again: bool = False) -> Save | KeepFile:
    """The one rule for saving a slot over its session's file, used by the swap, the save
    behind, the checkpoint and side requests: only when a fresh view of ``/slots`` proves
    the slot holds that session (``OURS``), restoring is on (no disk for files never
    restored) and the slot has turns the file lacks (``worth_saving``; ``again``: the
    checkpoint saves a session whose file has them too). Anything else is never saved over
    a file: it stays as it was (``KeepFile``)."""
    if view == OURS and not restoring_off and state.keeps_file and \
            (worth_saving(state) or (again and state.phase is Phase.OURS)):
        return Save(slot, state)
    return KeepFile(slot, state, view, restoring_off)


def saved_over(actions: list[Action]) -> bool:
    """Whether the actions save a slot over a file."""
    return any(isinstance(action, Save) for action in actions)


def undoable(actions: list[Action]) -> bool:
    """Whether a swap's actions can simply be done again if llama-server turned out to have
    changed meanwhile (``slots.fingerprints``): they write no file named and stamped with its
    fingerprint (no save, no base snapshot), they only claim, restore, erase and record."""
    return not any(isinstance(action, (Save, MakeBase)) for action in actions)


def worth_saving(state: SlotState) -> bool:
    """Whether the slot holds turns of a persistent session that its file lacks: ``OURS``
    means its file has them already (saved behind, or just restored), so a swap or a
    background save has nothing to write."""
    return state.phase is Phase.UNSAVED and state.keeps_file


def needs_slot_size(facts: SwapFacts) -> bool:
    """Whether a candidate passes every check but the slot's size: only then ask /slots."""
    return any(restore_problem(file, facts.made_by, None, facts.slot) is None
               for file, _ in candidates(facts))


# -- the rest ----------------------------------------------------------------------------
KV_FORMAT = "kv_format"  # the fingerprint's KV cache layout, from the start-up probe's file
LORA = "lora"            # the fingerprint's LoRA adapters applied, when any is


def applied_adapters(adapters: object) -> list[list] | None:
    """The LoRA adapters llama-server applies to every request (``GET /lora-adapters``), as
    ``[path, scale]`` in its order, those of scale 0 left out (loaded, not applied: they
    change no cache); None when none is. A cache computed under adapters is another model's."""
    applied = [[a.get("path"), a.get("scale")] for a in adapters if isinstance(a, dict)
               and a.get("scale")] if isinstance(adapters, list) else []
    return applied or None


def fingerprint(props: dict, models: dict, kv_format: str | None = None,
                lora: object = None) -> dict:
    """What made a slot file: a file from anything else must not be restored. ``kv_format``
    (cache types, V layout; ``slot_file.kv_format``) joins it once the start-up probe read it;
    ``lora`` (``GET /lora-adapters``) only when an adapter is applied, so files saved without
    one keep their fingerprint."""
    adapters = applied_adapters(lora)
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
        **({KV_FORMAT: kv_format} if kv_format else {}),
        **({LORA: adapters} if adapters else {}),
    }


def model_of(made_by: dict) -> str | None:
    """The tag of the model a fingerprint names (``identity.model_tag``): its files carry it."""
    return model_tag(made_by.get("model_path"))


def same_maker(saved: dict | None, running: dict) -> bool:
    """Whether the llama-server that made a file (``saved``, from its sidecar) is the one
    running. The KV format is compared only when both sides know it: files saved before
    kvproxy read it, or while its start-up probe could not, are judged on the rest (and a
    wrong format is then refused by llama-server itself, which ``refused_by`` remembers)."""
    if not isinstance(saved, dict):
        return False
    if KV_FORMAT in saved and KV_FORMAT in running:
        return saved == running
    return {k: v for k, v in saved.items() if k != KV_FORMAT} == \
        {k: v for k, v in running.items() if k != KV_FORMAT}


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


def incoming_stems(session: Session) -> set[str]:
    """Files a swap to ``session`` may restore, known before its facts are gathered: eviction
    must not delete them (``restorable_stems`` adds what the facts found)."""
    stems = {session.stem}
    if session.seed:
        stems.add(session.seed_stem)
    if session.base_hash:
        stems.add(base_stem(session.base_hash, session.model))
    return stems


def restorable_stems(facts: SwapFacts) -> set[str]:
    """Every file the swap's plan may restore: ``incoming_stems``, and the stored start of the
    prompt its facts found (``prefix``)."""
    return incoming_stems(facts.session) | ({facts.prefix.stem} if facts.prefix else set())


def side_slot(table: dict[int, SlotState], slot_ids: list[int]) -> int:
    """The slot a side task is leased (the caller holds them all): one holding no session
    kvproxy keeps, else one whose file has its turns, least recently used first."""
    def cost(slot: int) -> tuple[bool, bool, str]:
        state = table.get(slot) or SlotState()
        return state.keeps_file, worth_saving(state), state.used_at or ""
    return min(slot_ids, key=cost)


def save_before_side(state: SlotState) -> bool:
    """Whether a slot's session must be saved before a side request llama-server may run in
    that slot: a persistent session whose newest turns its file lacks, in a slot kvproxy can
    vouch for (an unproven slot is never saved over a file)."""
    return state.phase is Phase.UNSAVED and state.persistent and bool(state.session_id)


def side_landed_in(table: dict[int, SlotState], listing, slots: list[int]) -> list[int]:
    """The ``slots`` whose ``/slots`` entry no longer shows what the state table says they
    hold: a side request llama-server did not pin ran there. Slots already unproven are
    left out (nothing there is trusted anyway); an answer that is not a list proves nothing."""
    entries = {e.get("id"): e for e in (listing if isinstance(listing, list) else [])
               if isinstance(e, dict)}
    changed = []
    for slot in slots:
        state = table.get(slot) or SlotState()
        if state.phase in (Phase.CLAIMED, Phase.UNPROVEN):
            continue
        if judge_slot(entries.get(slot), state.tokens) != OURS:
            changed.append(slot)
    return changed


# -- policy of the executor's I/O ---------------------------------------------------------
def base_worth_making(system_tokens: list[int] | None) -> bool:
    """Whether a system prompt is long enough for a base snapshot of its own."""
    return bool(system_tokens) and len(system_tokens) >= MIN_BASE_TOKENS


def save_protected(stem: str, keep: set[str], held: set[str]) -> set[str]:
    """Files eviction must leave alone while ``stem`` is saved: itself, the files the swap
    may restore (``keep``), and those of sessions other slots (of any model) hold
    (``held``): they may be saved over, not evicted."""
    return {stem, *keep, *held}


def trim_after_save(saved_bytes: int, room_made: int) -> bool:
    """Whether a save came out bigger than the room made for it: the folder is trimmed."""
    return saved_bytes > room_made


def remember_refusal(status: int | None, made_by: dict | None) -> bool:
    """Whether a failed restore is written into the file's sidecar as refused by this
    llama-server: only its 400 (the file does not fit it), and only against a confirmed
    fingerprint (planned with an unconfirmed one, the server refusing may be another)."""
    return status == REFUSED_STATUS and made_by is not None

