"""The one place that decides what the single llama-server slot holds.

A request takes a ``Lease`` on the slot: the lease swaps the slot to the
request's session (save the old one, restore or erase for the new one) and is
held until the request's last byte, because llama-server queues slot actions
behind a running generation and a completion could overtake a queued save.
Nothing here knows a client wire format.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import quote
from typing import Any, Callable, Iterator, Protocol

from . import disk, metrics
from .identity import DEFAULT_SESSION, Session, base_stem
from .activity import RecentActivity
from .llama import LlamaClient, UpstreamError, UpstreamUnavailable
from .plan import (EMPTY, FOREIGN, OURS, UNKNOWN, fingerprint, fingerprint_key, judge_slot,
                   plan_swap)
from .restore_check import RestoreCheck, verify_restore
from .slotlock import ClientGone, SlotBusy, SlotLock, SlotUnavailable
from .store import SessionStore, StorageError, now_iso

log = logging.getLogger("kvproxy.switch")

# Cache states reported to clients in X-KVProxy-Cache.
HIT, RESTORED, BASE, MISS = "hit", "restored", "base", "miss"

# A system prompt shorter than this is not worth a snapshot of its own.
MIN_BASE_TOKENS = 32

__all__ = ["SlotSwitch", "Lease", "SlotBusy", "SlotUnavailable", "ClientGone", "HIT", "RESTORED",
           "BASE", "MISS", "header_safe", "judge_slot", "fingerprint", "fingerprint_key", "OURS", "EMPTY", "FOREIGN", "UNKNOWN"]


class PromptView(Protocol):
    """The request's prompt as llama-server tokenizes it (the relay provides it; asked lazily)."""

    def tokens(self) -> list[int]: ...

    def system_tokens(self, min_tokens: int = 0) -> list[int] | None: ...


@dataclass
class Lease:
    """The slot, held for one request."""

    session: Session
    cache: str
    restored_tokens: int = 0
    swap_ms: float = 0.0
    restored_stem: str | None = None
    made_by: dict | None = None  # what llama-server runs, when the swap asked
    prompt: PromptView | None = field(default=None, repr=False)  # for the restore check
    _release: Any = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        return {"X-KVProxy-Session": header_safe(self.session.id), "X-KVProxy-Cache": self.cache}


def header_safe(text: str) -> str:
    """An id as an HTTP header value: printable ASCII as is, anything else percent-encoded,
    so a hostile id from a request body can neither break nor inject response headers."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text
    # backslashreplace: a lone surrogate cannot be UTF-8 encoded and must not raise here.
    return quote(text.encode("utf-8", "backslashreplace"), safe="")


class SlotSwitch:
    """Serialises all use of the slot across threads and processes."""

    def __init__(self, client: LlamaClient, store: SessionStore, slot_id: int = 0,
                 lock_timeout: float = 300, base_snapshots: bool = True,
                 restore_miss_limit: int = 2, max_disk_bytes: int = 0, min_free_bytes: int = 0,
                 max_waiters: int = 32, restore_off_minutes: float = 60):
        self.client = client
        self.store = store
        self.activity = RecentActivity()  # recent swaps and outcomes, for /status and the CLI
        self.slot_id = slot_id
        self.base_snapshots = base_snapshots
        self.max_disk_bytes = max_disk_bytes
        self.budget = disk.DiskBudget(store, max_disk_bytes, min_free_bytes)
        self.lock = SlotLock(store.lock_path, lock_timeout, max_waiters)
        self.restore_check = RestoreCheck(store.root, restore_miss_limit, restore_off_minutes)
        # Set when a swap failed half-way: until the next good swap, the slot is not trusted.
        self._uncertain = False

    @property
    def _thread_lock(self):
        return self.lock.thread_lock

    # -- locking -----------------------------------------------------------
    def acquire(self, session: Session, *, still_wanted: Callable[[], bool] | None = None,
                prompt: PromptView | None = None) -> Lease:
        """Wait (bounded) for the slot, then swap it to ``session``.

        Whatever fails on the way frees the slot. A failure that is not
        llama-server's answer or absence becomes ``SlotUnavailable`` (503).
        When the request had to wait and ``still_wanted`` says its client has
        left, nothing is swapped (``ClientGone``).
        """
        waited = self.lock.acquire()
        try:
            if waited and still_wanted is not None and not still_wanted():
                metrics.REJECTED.labels("client_gone").inc()
                log.info("client of session %s left while waiting for the slot: no swap",
                         session.id)
                raise ClientGone()
            lease = self._swap_to(session, prompt)
        except BaseException as exc:
            self.lock.release()
            if isinstance(exc, ClientGone):
                raise
            self._mark_unknown()
            if isinstance(exc, (UpstreamError, UpstreamUnavailable, SlotUnavailable, StorageError)) \
                    or not isinstance(exc, Exception):
                raise
            log.exception("swapping the slot to session %s failed", session.id)
            raise SlotUnavailable(f"the slot could not be prepared ({exc.__class__.__name__}); "
                                  "see kvproxy's log") from exc
        lease._release = self.lock.release
        return lease

    def _mark_unknown(self) -> None:
        """After a failed swap: trust nothing the slot holds until the next good swap.

        Kept in memory and, when the disk allows, in the state file, so another
        process sharing the folder does not trust the slot either.
        """
        self._uncertain = True
        try:
            self.store.write_state({**self.store.read_state(), "slot_unknown": True})
        except Exception:  # noqa: BLE001 - the disk may be why the swap failed
            log.warning("could not mark the slot as unknown in the state file")

    @contextlib.contextmanager
    def holding(self, timeout: float) -> Iterator[bool]:
        """The slot, for kvproxy's own housekeeping (start-up sweep and checks): yields
        False, holding nothing, when it is not free within ``timeout`` seconds."""
        try:
            self.lock.acquire(timeout=timeout)
        except SlotUnavailable:
            yield False
            return
        try:
            yield True
        finally:
            self.lock.release()

    def release(self, lease: Lease, timings: dict | None = None) -> None:
        """Record what the request showed about the cache, then free the slot. Idempotent."""
        unlock, lease._release = lease._release, None
        if unlock is None:
            return
        try:
            self._after_request(lease, timings or {})
        except Exception:  # bookkeeping must never keep the slot locked
            log.exception("recording the request of session %s failed", lease.session.id)
        finally:
            unlock()

    # -- swapping ----------------------------------------------------------
    def busy(self) -> bool:
        """Whether a request (or an admin action) in this process holds the slot now."""
        return self._thread_lock.locked()

    def current_made_by(self) -> dict:
        return fingerprint(self.client.props(), self.client.models())

    def _swap_to(self, session: Session, prompt: PromptView | None = None) -> Lease:
        state = self.store.read_state()
        keep = state.get("active_key") == session.key
        view = self._slot_view(state, trust_connection=keep)
        plan = plan_swap(state, session.key, view)
        if plan.hit:
            metrics.SWAPS.labels("none").inc()
            return Lease(session, HIT, prompt=prompt)
        started = time.monotonic()
        made_by = self.current_made_by()
        if plan.save_active:
            self._save(state["active"], state["active_stem"], made_by, kind="session",
                       system_hash=state.get("active_system_hash"), keep=incoming_stems(session))
        elif plan.keep_file:
            log.info("not saving session %s: the slot is %s (kvproxy cannot prove it "
                     "holds that session); its file stays as it was", state["active"], view)
        restoring_off = self.restore_check.restoring_off(fingerprint_key(made_by))
        self._mark_slot_unknown(state)
        cache, restored, restored_stem = self._load(session, made_by, restoring_off, prompt)
        self.store.write_state({**state, "active": session.id, "active_key": session.key,
                                "active_stem": session.stem,
                                "active_persistent": session.persistent,
                                "active_system_hash": session.system_hash,
                                "slot_tokens": restored, "slot_unknown": False,
                                "updated_at": now_iso()})
        self._uncertain = False
        swap_ms = (time.monotonic() - started) * 1000
        log.info("swap to session=%s source=%s cache=%s slot=%s restored_tokens=%d swap_ms=%.1f",
                 session.id, session.source, cache, view, restored, swap_ms)
        return Lease(session, cache, restored, swap_ms, restored_stem, made_by, prompt)

    def _slot_view(self, state: dict, trust_connection: bool = False) -> str:
        """Whether the slot holds what kvproxy's last action left in it (``OURS``), or not.

        With ``trust_connection``, a connection still open since the last slot
        call counts as proof that llama-server did not restart, and ``/slots``
        is not asked. Only the no-swap path trusts it: it cannot see a client
        that talked to llama-server directly, but the worst outcome there is one
        prefill (llama-server answers from what it holds either way). A swap
        always asks: an uncertain slot must never be saved over a session's file.
        """
        if self._uncertain or state.get("slot_unknown"):
            return UNKNOWN
        expected = int(state.get("slot_tokens") or 0)
        if trust_connection and expected > 0 and self.client.same_server_as_last_slot_call():
            return OURS
        try:
            slots = self.client.slots()
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("GET /slots failed (%s): the slot is treated as foreign", exc)
            return UNKNOWN
        entry = next((s for s in slots if isinstance(s, dict) and s.get("id") == self.slot_id), None)
        return judge_slot(entry, expected)

    def _mark_slot_unknown(self, state: dict) -> None:
        """Before the slot changes, the state file stops naming what it held: if the swap
        fails half-way, the next request restores instead of trusting the slot."""
        self.store.write_state({**state, "active": None, "active_key": None, "active_stem": None,
                                "active_persistent": False, "active_system_hash": None,
                                "slot_tokens": 0, "updated_at": now_iso()})

    def _save(self, session_id: str, stem: str, made_by: dict, kind: str,
              system_hash: str | None, keep: set[str] = frozenset()) -> dict | None:
        """Save the slot as ``<stem>.bin``: room made first, written under a temporary name,
        checked, then renamed over the old file. A disk that cannot take it raises
        StorageError with the old file untouched; llama-server out of reach gives None."""
        state = self.store.read_state()
        protected = {stem, *keep, state.get("active_stem")}
        tokens = int(state.get("slot_tokens") or 0)
        estimate = self.budget.make_room(stem, tokens, made_by, protected)
        started = time.monotonic()

        def describe(answer: dict, size: int) -> dict:
            save_ms = (answer.get("timings") or {}).get("save_ms",
                                                        (time.monotonic() - started) * 1000)
            metrics.observe_swap("save", time.monotonic() - started, size)
            return self.store.merged_sidecar(
                stem, {"session_id": session_id, "kind": kind},
                session_id=session_id, kind=kind, system_hash=system_hash, made_by=made_by,
                n_tokens=answer.get("n_saved"), n_bytes=answer.get("n_written"), saved_bytes=size,
                save_ms=round(save_ms, 2), saved_at=now_iso(), refused=None)
        try:
            sidecar = disk.checked_save(self.client, self.slot_id, self.store, stem, describe)
        except UpstreamUnavailable as exc:
            log.warning("could not save session %s: %s", session_id, exc)
            return None
        if sidecar is None:
            log.warning("not saving session %s: the slot is empty", session_id)
            return None
        if sidecar["saved_bytes"] > estimate:  # bigger than room was made for
            self.budget.trim(protected)
        return sidecar

    def _restorable(self, stem: str, made_by: dict) -> dict | None:
        """The sidecar of a file that may be restored into this llama-server, else None."""
        if not self.store.has_bin(stem):
            return None
        sidecar = self.store.read_sidecar(stem)
        if not sidecar or not sidecar.get("saved_at"):
            log.warning("not restoring %s.bin: it has no sidecar saying what made it", stem)
            return None
        problem = disk.size_problem(self.store, stem, sidecar)
        if problem:
            log.warning("not restoring %s.bin: %s; %s, the session starts fresh",
                        stem, problem, disk.set_aside(self.store, stem, problem))
            metrics.RESTORE_MISSES.labels("bad_file").inc()
            return None
        if sidecar.get("made_by") != made_by:
            reason = f"made by {sidecar.get('made_by')}, running {made_by}"
            log.warning("not restoring %s.bin: %s", stem, reason)
            self.store.update_sidecar(stem, {}, refused=reason, refused_at=now_iso())
            metrics.RESTORE_MISSES.labels("model_mismatch").inc()
            return None
        return sidecar

    def _load(self, session: Session, made_by: dict, restoring_off: bool,
              prompt: PromptView | None = None) -> tuple[str, int, str | None]:
        """Fill the slot for ``session``: its own file, else a base snapshot, else empty
        (and then, for a system prompt seen first, a snapshot of that system prompt alone)."""
        if session.persistent and not restoring_off:
            candidates = [(session.stem, RESTORED)]
            if self.base_snapshots and session.system_hash:
                candidates.append((base_stem(session.system_hash), BASE))
            for stem, cache in candidates:
                if self._restorable(stem, made_by):
                    restored = self._restore(stem)
                    if restored is not None:
                        return cache, restored, stem
        self._erase()
        held = 0
        if prompt is not None and not restoring_off and self._wants_base(session, made_by):
            held = self._make_base(session, made_by, prompt)
        return MISS, held, None

    def _wants_base(self, session: Session, made_by: dict) -> bool:
        if not (self.base_snapshots and session.persistent and session.system_hash):
            return False
        stem = base_stem(session.system_hash)
        sidecar = self.store.read_sidecar(stem)
        return not (self.store.has_bin(stem) and sidecar and sidecar.get("made_by") == made_by)

    def _make_base(self, session: Session, made_by: dict, prompt: PromptView) -> int:
        """Prefill the system prompt alone and save it as the base snapshot.

        Never the first user's message or answer: a later conversation could
        probe them through the cached-token counts every API reports. Returns
        the tokens the slot then holds (0 when no base was made).
        """
        system_hash = session.system_hash
        try:
            tokens = prompt.system_tokens(MIN_BASE_TOKENS)
            if not tokens or len(tokens) < MIN_BASE_TOKENS:
                return 0
            timings = self.client.prefill(tokens, self.slot_id).get("timings") or {}
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("no base snapshot for system prompt %s: %s", system_hash, exc)
            self._erase()
            return 0
        # Not in the answer's timings: count it here, so computed tokens add up.
        computed = int(timings.get("prompt_n") or 0)
        metrics.TOKENS.labels("computed").inc(computed)
        metrics.TOKENS.labels("reused").inc(int(timings.get("cache_n") or 0))
        if self._save(f"base:{system_hash}", base_stem(system_hash), made_by, kind="base",
                      system_hash=system_hash):
            metrics.SWAPS.labels("base").inc()
            self.store.update_sidecar(base_stem(system_hash), {}, prefill_computed=computed)
        return len(tokens)

    def _restore(self, stem: str) -> int | None:
        started = time.monotonic()
        try:
            answer = self.client.slot_action(self.slot_id, "restore", f"{stem}.bin")
        except UpstreamError as exc:  # a failed restore wipes the slot; erase keeps it clean
            log.warning("restore of %s.bin failed: %s", stem, exc.message)
            metrics.RESTORE_MISSES.labels("failed").inc()
            return None
        restore_ms = (answer.get("timings") or {}).get("restore_ms",
                                                       (time.monotonic() - started) * 1000)
        metrics.observe_swap("restore", time.monotonic() - started, answer.get("n_read", 0))
        self.store.update_sidecar(stem, {}, count="restores", restore_ms=round(restore_ms, 2),
                                  last_used_at=now_iso())
        return int(answer.get("n_restored") or 0)

    def _erase(self) -> None:
        started = time.monotonic()
        self.client.slot_action(self.slot_id, "erase")
        metrics.observe_swap("erase", time.monotonic() - started, 0)

    def clear(self) -> None:
        """Erase the slot and make ``default`` active; waits for the slot like a request."""
        lease = self.acquire(Session(DEFAULT_SESSION, "admin", persistent=False))
        try:
            if lease.cache == HIT:
                self._erase()
        finally:
            self.release(lease)

    def checkpoint(self, timeout: float = 10) -> bool:
        """Save the active session now (at shutdown), so a later llama-server restart loses nothing."""
        try:
            self.lock.acquire(timeout)
        except SlotUnavailable:
            return False
        try:
            state = self.store.read_state()
            if not (state.get("active_persistent") and state.get("active")) \
                    or self._slot_view(state) != OURS:
                return False
            return self._save(state["active"], state["active_stem"], self.current_made_by(),
                              kind="session", system_hash=state.get("active_system_hash")) is not None
        except (UpstreamError, UpstreamUnavailable, StorageError) as exc:
            log.warning("could not save the active session at shutdown: %s", exc)
            return False
        finally:
            self.lock.release()

    def forget(self, session_id: str) -> bool:
        """Delete a session's (or base snapshot's) files; erase the slot if it holds it.

        With llama-server down the files still go: the slot is then marked
        unknown, so what it holds is never saved or trusted again.
        """
        stems = {s["stem"] for s in self.store.sidecars() if s.get("session_id") == session_id}
        stems.add(Session(session_id, "admin").stem)  # a file left without its sidecar
        self.lock.acquire()
        try:
            state = self.store.read_state()
            if state.get("active") == session_id:
                try:
                    self._erase()
                except (UpstreamError, UpstreamUnavailable) as exc:
                    log.warning("could not erase the slot of deleted session %s: %s", session_id, exc)
                    self._uncertain = True
                self.store.write_state({**state, "active": DEFAULT_SESSION, "active_key": None,
                                        "active_stem": None,
                                        "active_persistent": False, "active_system_hash": None,
                                        "slot_tokens": 0, "slot_unknown": self._uncertain,
                                        "updated_at": now_iso()})
            removed = [self.store.delete(stem) for stem in stems]
            return any(removed)
        finally:
            self.lock.release()

    # -- after the request -------------------------------------------------
    def _after_request(self, lease: Lease, timings: dict) -> None:
        session = lease.session
        cache_n = int(timings.get("cache_n") or 0)
        prompt_n = int(timings.get("prompt_n") or 0)
        predicted_n = int(timings.get("predicted_n") or 0)
        metrics.TOKENS.labels("reused").inc(cache_n)
        metrics.TOKENS.labels("computed").inc(prompt_n)
        self.activity.record(lease, timings)
        state = self.store.read_state()
        if timings:  # what the slot now holds: compared with /slots before the next swap
            held = cache_n + prompt_n + predicted_n
            if state.get("slot_tokens") != held:
                self.store.write_state({**state, "slot_tokens": held})
        else:
            self._note_slot_after_cut(state)
        if lease.cache in (RESTORED, BASE) and timings:
            self._verify_restore(lease, cache_n)
        if not session.persistent:
            return
        self.store.update_sidecar(session.stem, {"session_id": session.id, "kind": "session"},
                                  count="hits", session_id=session.id, last_used_at=now_iso(),
                                  last_cache=lease.cache, last_cache_n=cache_n,
                                  last_prompt_n=prompt_n)

    def _note_slot_after_cut(self, state: dict) -> None:
        """An answer that ended without timings (cut short at shutdown, client gone): ask
        ``/slots`` what the slot holds now, while the lock still keeps everyone else out, so
        the next swap or the save at shutdown can still prove the slot is this session's."""
        try:
            slots = self.client.slots()
        except (UpstreamError, UpstreamUnavailable):
            return  # llama-server gone: the next swap finds the slot empty or unknown
        entry = next((s for s in slots if isinstance(s, dict) and s.get("id") == self.slot_id), None)
        held = int(entry.get("n_prompt_tokens") or 0) if entry and "id_task" in entry else 0
        if held and state.get("slot_tokens") != held:
            self.store.write_state({**state, "slot_tokens": held})

    def _verify_restore(self, lease: Lease, cache_n: int) -> None:
        """Count restores that llama-server reported but did not use (see restore_check)."""
        key = fingerprint_key(lease.made_by or self.current_made_by())
        if verify_restore(self.restore_check, self.store, lease, cache_n, key) == "not_honoured":
            metrics.RESTORE_MISSES.labels("not_honoured").inc()


def incoming_stems(session: Session) -> set[str]:
    """Files a swap to ``session`` may restore: eviction must not delete them."""
    stems = {session.stem}
    if session.system_hash:
        stems.add(base_stem(session.system_hash))
    return stems
