"""The one place that decides what each llama-server slot holds.

A request takes a ``Lease`` on one slot (``SlotPool`` picks it, see
``placement``): the lease swaps that slot to the request's session (save the
old one, restore or erase for the new one) and is held until the request's
last byte, because llama-server queues slot actions behind a running
generation and a completion could overtake a queued save. Every upstream call
of the lease is pinned to its slot. Nothing here knows a client wire format.

``SlotSwitch`` is built from one ``SwitchSettings`` and puts the parts together: the request
path (``requests``: lease, swap, after the answer), the swap itself (``swap``), and the
housekeeping (``housekeeping``: clear, forget, checkpoint, save behind). Its public methods
are the switch's whole interface for the rest of kvproxy.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from kvproxy.config import SETTINGS
from kvproxy.telemetry.activity import RecentActivity
from kvproxy.sessions.identity import DEFAULT_SESSION, Session
from kvproxy.slots import instance
from kvproxy.slots.deletions import Deletions
from kvproxy.slots.executor import SlotExecutor
from kvproxy.slots.fingerprints import Fingerprints
from kvproxy.slots.housekeeping import SlotHousekeeping
from kvproxy.slots.lease import Lease
from kvproxy.slots.lock import ClientGone, SlotBusy, SlotLock, SlotUnavailable
from kvproxy.slots.outcome import HeldElsewhere, PromptView  # noqa: F401
from kvproxy.slots.plan import (BASE, EMPTY, FOREIGN, HIT, MIN_BASE_TOKENS, MISS,  # noqa: F401
                                OURS, RESTORED, UNKNOWN, fingerprint, fingerprint_key,
                                judge_slot)
from kvproxy.slots.pool import SlotPool
from kvproxy.slots.requests import SlotRequests
from kvproxy.slots.restore_check import RestoreCheck
from kvproxy.slots.save_behind import SaveBehind
from kvproxy.slots.state import SlotState, SlotTable
from kvproxy.slots.swap import SlotGone, SlotSwaps  # noqa: F401
from kvproxy.storage.folder import FolderFiles
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.store import SessionStore
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable

log = logging.getLogger("kvproxy.switch")

__all__ = ["SlotSwitch", "SwitchSettings", "Lease", "SlotBusy", "SlotUnavailable", "ClientGone",
           "HIT", "RESTORED", "BASE", "MISS", "judge_slot", "fingerprint", "fingerprint_key",
           "OURS", "EMPTY", "FOREIGN", "UNKNOWN"]


def _shipped(name: str):
    """A setting's shipped default, parsed (``config.SETTINGS``)."""
    setting = next(s for s in SETTINGS if s.name == name)
    return setting.parse(setting.default)


@dataclass(frozen=True)
class SwitchSettings:
    """What a switch is built from; every default is the shipped setting's (``config``)."""

    slot_id: int = _shipped("slot_id")                  # the slot a single-slot kvproxy drives
    lock_timeout: float = _shipped("lock_timeout")
    base_snapshots: bool = _shipped("base_snapshots")
    restore_miss_limit: int = _shipped("restore_miss_limit")
    max_disk_bytes: int = int(_shipped("max_disk_gb") * 1024**3)
    min_free_bytes: int = int(_shipped("min_free_gb") * 1024**3)
    max_waiters: int = _shipped("max_waiters")
    restore_off_minutes: float = _shipped("restore_off_minutes")
    slots: int = _shipped("slots")                      # 0: as many as llama-server has
    save_behind: bool = _shipped("save_behind")
    save_behind_delay: float = _shipped("save_behind_delay")
    slot_keep: float = _shipped("slot_keep")
    session_store: str = _shipped("session_store")      # "chunks" or "files"
    chunk_tokens: int = _shipped("chunk_tokens")
    shared: object = None   # the shared store (KVPROXY_STORE_URL): storage.shared's SharedStore
    hot: object = None      # hot copies (KVPROXY_HOT_DIR): storage.chunks.hot's HotCopies

    @classmethod
    def of(cls, settings) -> "SwitchSettings":
        """The switch's part of kvproxy's ``config.Settings``."""
        return cls(settings.slot_id, settings.lock_timeout, settings.base_snapshots,
                   settings.restore_miss_limit, int(settings.max_disk_gb * 1024**3),
                   int(settings.min_free_gb * 1024**3), settings.max_waiters,
                   settings.restore_off_minutes, settings.slots, settings.save_behind,
                   settings.save_behind_delay, settings.slot_keep, settings.session_store,
                   settings.chunk_tokens)


_FIELDS = [f.name for f in dataclasses.fields(SwitchSettings)]


class SlotSwitch:
    """Leases llama-server's slots to requests and swaps each to its request's session.

    With one slot it behaves as kvproxy always did. With several, ``SlotPool``
    picks the slot (``placement``): the one holding the session, else an idle
    one, saving its session first when it holds one. What a swap does is
    decided by ``plan`` and carried out by ``SlotExecutor``.

    Built from ``settings`` (``SwitchSettings``); keyword arguments named as its fields
    override it, and positional ones follow its order after ``client`` and ``store``.
    """

    def __init__(self, client: LlamaClient, store: SessionStore, *args,
                 settings: SwitchSettings | None = None, **overrides):
        settings = settings or SwitchSettings()
        changes = dict(zip(_FIELDS, args), **overrides)
        self.settings = dataclasses.replace(settings, **changes) if changes else settings
        s = self.settings
        self.client = client
        self.store = store
        store.legacy_slot = s.slot_id
        self.table = SlotTable(store)
        self.activity = RecentActivity()  # recent swaps and outcomes, for /status and the CLI
        self.slot_id = s.slot_id
        self.configured_slots = s.slots
        self._slot_ids: list[int] | None = [s.slot_id] if s.slots == 1 else (
            list(range(s.slots)) if s.slots > 1 else None)
        self.base_snapshots = s.base_snapshots
        self.max_disk_bytes = s.max_disk_bytes
        self.lock_timeout = s.lock_timeout
        self.files = ChunkedFiles(store, s.max_disk_bytes, s.min_free_bytes, s.chunk_tokens,
                                  s.shared, s.hot) \
            if s.session_store == "chunks" else FolderFiles(store, s.max_disk_bytes, s.min_free_bytes)
        self.budget = self.files.budget
        self.pool = SlotPool(store, s.lock_timeout, s.max_waiters, keep=s.slot_keep)
        self.restore_check = RestoreCheck(store.root, s.restore_miss_limit,
                                          s.restore_off_minutes)
        self.executor = SlotExecutor(client, store, self.table, self.files, self.restore_check)
        self.fingerprints = Fingerprints(client, lambda: self.kv_format)
        # Sessions deleted while leases ran (shared by every model's switch: ModelSwitches).
        self.deletions = Deletions()
        self.swaps = SlotSwaps(self)
        self.requests = SlotRequests(self)
        self.housekeeping = SlotHousekeeping(self)
        # New turns saved in the background once a slot has settled (see save_behind).
        self.saver = SaveBehind(self.save_settled, s.save_behind_delay) \
            if s.save_behind else None

    # -- the slots ---------------------------------------------------------
    def slot_ids(self) -> list[int]:
        """The slots kvproxy drives: ``KVPROXY_SLOTS``, else as many as llama-server reports
        (asked once it answers; until then the one slot ``KVPROXY_SLOT_ID``)."""
        if self._slot_ids is None:
            total = self._llama_slot_count()
            if total is None:
                return [self.slot_id]
            self._slot_ids = instance.driven_slots(self.configured_slots, self.slot_id, total)
            log.info("driving %d llama-server slot(s): %s", len(self._slot_ids), self._slot_ids)
        return self._slot_ids

    def drive(self, slots: list[int]) -> list[int] | None:
        """Drive ``slots`` from now on (llama-server restarted); returns the slots driven before."""
        old, self._slot_ids = self._slot_ids, slots
        return old

    def _llama_slot_count(self) -> int | None:
        try:
            # autoload=False: behind a router, a listing must never load the model
            total = self.client.view.props(autoload=False).get("total_slots")
            if isinstance(total, int) and total > 0:
                return total
            slots = self.client.slots()
            return len(slots) if isinstance(slots, list) and slots else None
        except (UpstreamError, UpstreamUnavailable, AttributeError):
            return None

    @property
    def lock(self) -> SlotLock:
        """The lock of the first slot (the only one with a single slot)."""
        return self.pool.lock(self.slot_ids()[0])

    # -- the request path (requests.py) -------------------------------------
    def acquire(self, session: Session, *, still_wanted: Callable[[], bool] | None = None,
                prompt: PromptView | None = None) -> Lease:
        """Wait (bounded) for a slot, then swap it to ``session`` (``SlotRequests.acquire``)."""
        return self.requests.acquire(session, still_wanted=still_wanted, prompt=prompt)

    def release(self, lease: Lease, timings: dict | None = None) -> None:
        """Record what the request showed about the cache, then free the slot. Idempotent."""
        self.requests.release(lease, timings)

    def swap_held(self, slot: int, session: Session, placed: str) -> Lease:
        """Swap ``slot``, which the caller holds and frees itself (side tasks), to ``session``."""
        return self.swaps.swap_held(slot, session, placed)

    def busy_since(self, slot: int) -> str | None:
        """When the request holding ``slot`` took it: set once its swap is done, forgotten by
        ``release`` before the slot is freed, so an idle slot has none."""
        return self.requests.busy_since.get(slot)

    # -- housekeeping (housekeeping.py) ---------------------------------------
    def save_settled(self, slot: int) -> bool:
        """Save the new turns ``slot`` holds in the background, if it is free now."""
        return self.housekeeping.save_settled(slot)

    def clear(self, slot: int | None = None) -> list[int]:
        """Save what a slot (default: every slot) holds, erase it and make ``default`` its
        session; waits for each slot like a request. Returns the slots cleared."""
        return self.housekeeping.clear(slot)

    def checkpoint(self, timeout: float = 10, unsaved_only: bool = False) -> bool:
        """Save the session of every slot now (``SlotHousekeeping.checkpoint``)."""
        return self.housekeeping.checkpoint(timeout, unsaved_only)

    def forget(self, session_id: str) -> bool:
        """Delete a session's (or base snapshot's) files; erase every slot that holds it."""
        return self.housekeeping.forget(session_id)

    def empty_slots_of(self, session_id: str, loaded: bool = True) -> None:
        """Erase every slot that holds ``session_id`` and record it empty."""
        self.housekeeping.empty_slots_of(session_id, loaded)

    def delete_files(self, session_id: str) -> bool:
        """Delete every file of ``session_id``, of any model; False when there was none."""
        return self.housekeeping.delete_files(session_id)

    def mark_unknown(self, slot: int) -> None:
        """After a failed swap: trust nothing the slot holds until its next good swap."""
        self.executor.mark_unproven(slot)

    def save_held(self, slot: int, state: SlotState, made_by: dict,
                  keep: set[str] = frozenset()) -> dict | None:
        """Save the session ``state`` says ``slot`` holds into its own file (caller holds it
        and decided it with ``plan.save_or_keep``)."""
        return self.executor.save_session(slot, state, made_by, keep)

    # -- holding slots for kvproxy's own work --------------------------------
    @contextlib.contextmanager
    def holding(self, timeout: float, slots: list[int] | None = None) -> Iterator[bool]:
        """Every slot (or ``slots``), for kvproxy's own housekeeping (start-up sweep and checks):
        yields False, holding nothing, when they are not all free within ``timeout`` seconds."""
        taken: list[int] = []
        deadline = time.monotonic() + timeout
        try:
            for slot in (self.slot_ids() if slots is None else slots):
                try:
                    self.pool.lock(slot).acquire(timeout=max(0.0, deadline - time.monotonic()))
                except SlotUnavailable:
                    yield False
                    return
                taken.append(slot)
            yield True
        finally:
            for slot in reversed(taken):
                self.pool.give_back(slot)

    def try_hold(self, slot: int) -> bool:
        """Take ``slot`` only if it is free now (side requests protect idle slots this way)."""
        return self.pool.lock(slot).try_acquire()

    def give_back(self, slot: int) -> None:
        """Free a slot taken with ``try_hold`` or ``holding``."""
        self.pool.give_back(slot)

    # -- what the switch knows -------------------------------------------------
    def busy(self, slot: int) -> bool:
        """Whether a request (or an admin action) in this process holds ``slot`` now."""
        return slot in self.pool.busy_here()

    def slot_listing(self) -> list[dict]:
        """Every driven slot as the admin API lists it: from the state table and this
        process's locks, without asking llama-server."""
        table = self.table.read()
        return [slot_row(slot, self.executor.recorded(slot, table.get(slot) or SlotState()),
                         self.busy(slot), self.busy_since(slot),
                         self.executor.memory.n_ctx.get(slot))
                for slot in self.slot_ids()]

    def llama_slots(self) -> list:
        """llama-server's ``/slots`` listing, as it is now (raises when it cannot answer)."""
        return self.client.slots()

    def current_made_by(self) -> dict:
        """The running llama-server's fingerprint (``Fingerprints.now``)."""
        return self.fingerprints.now()

    @property
    def kv_format(self) -> str | None:
        """The KV cache layout llama-server writes (``slot_file.kv_format``): from the restore
        probe, then from every file saved, so a restart with other cache types shows at once."""
        return self.executor.memory.kv_format

    def slot_view(self, state: SlotState, slot: int, trust_connection: bool = False) -> str:
        """Whether the slot holds what kvproxy's last action left in it (``OURS``), or not."""
        return self.executor.facts.view(state, slot, trust_connection)


def slot_row(slot: int, state: SlotState, busy: bool, busy_since: str | None,
             n_ctx: int | None) -> dict:
    """One slot's row: the session it holds, its tokens, busy or idle and since when."""
    return {"id": slot, "session_id": state.session_id or DEFAULT_SESSION,
            "persistent": state.persistent,
            "file": f"{state.stem}.bin" if state.stem else None,
            "tokens": state.tokens, "n_ctx": n_ctx,
            "busy": busy, "busy_since": busy_since,
            "unproven": state.phase.value in ("claimed", "unproven"),
            "since": state.updated_at, "last_used_at": state.used_at}
