"""The one place that decides what the single llama-server slot holds.

A request takes a ``Lease`` on the slot: the lease swaps the slot to the
request's session (save the old one, restore or erase for the new one) and is
held until the request's last byte, because llama-server queues slot actions
behind a running generation and a completion could overtake a queued save.
Nothing here knows a client wire format.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import quote
from typing import Any

import filelock

from . import metrics
from .identity import DEFAULT_SESSION, Session, base_stem
from .activity import RecentActivity
from .llama import LlamaClient, UpstreamError, UpstreamUnavailable
from .store import SessionStore, now_iso

log = logging.getLogger("kvproxy.switch")

# Cache states reported to clients in X-KVProxy-Cache.
HIT, RESTORED, BASE, MISS = "hit", "restored", "base", "miss"

# A restore counts as honoured when the next answer reused at least this share
# of the restored tokens. Sliding-window and hybrid models report a successful
# restore and then recompute everything (llama.cpp issues 26676, 28194, 25913).
HONOURED_SHARE = 0.1
MIN_TOKENS_TO_VERIFY = 64


class SlotBusy(RuntimeError):
    """The slot stayed taken for longer than the configured bound."""

    def __init__(self, waited: float, retry_after: int):
        super().__init__(f"the model is busy with another conversation; waited {waited:.0f} s")
        self.retry_after = retry_after


@dataclass
class Lease:
    """The slot, held for one request."""

    session: Session
    cache: str
    restored_tokens: int = 0
    swap_ms: float = 0.0
    restored_stem: str | None = None
    made_by: dict | None = None  # what llama-server runs, when the swap asked
    _release: Any = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        return {"X-KVProxy-Session": header_safe(self.session.id), "X-KVProxy-Cache": self.cache}


def header_safe(text: str) -> str:
    """An id as an HTTP header value: printable ASCII as is, anything else percent-encoded,
    so a hostile id from a request body can neither break nor inject response headers."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text
    return quote(text, safe="")


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


class SlotSwitch:
    """Serialises all use of the slot across threads and processes."""

    def __init__(self, client: LlamaClient, store: SessionStore, slot_id: int = 0,
                 lock_timeout: float = 300, base_snapshots: bool = True,
                 restore_miss_limit: int = 2, max_disk_bytes: int = 0):
        self.client = client
        self.store = store
        self.activity = RecentActivity()  # recent swaps and outcomes, for /status and the CLI
        self.slot_id = slot_id
        self.lock_timeout = lock_timeout
        self.base_snapshots = base_snapshots
        self.restore_miss_limit = restore_miss_limit
        self.max_disk_bytes = max_disk_bytes
        self._thread_lock = threading.Lock()
        self._file_lock = filelock.FileLock(str(store.lock_path), thread_local=False)

    # -- locking -----------------------------------------------------------
    def acquire(self, session: Session) -> Lease:
        """Wait (bounded) for the slot, then swap it to ``session``."""
        self._lock()
        try:
            lease = self._swap_to(session)
        except BaseException:
            self._unlock()
            raise
        lease._release = self._unlock
        return lease

    def _lock(self) -> None:
        """Take the thread lock, then the cross-process file lock, within one bound."""
        started = time.monotonic()
        if not self._thread_lock.acquire(timeout=self.lock_timeout):
            raise self._busy(started)
        try:
            remaining = max(0.0, self.lock_timeout - (time.monotonic() - started))
            self._file_lock.acquire(timeout=remaining)
        except filelock.Timeout:
            self._thread_lock.release()
            raise self._busy(started) from None
        metrics.LOCK_WAIT.observe(time.monotonic() - started)

    def _busy(self, started: float) -> SlotBusy:
        waited = time.monotonic() - started
        return SlotBusy(waited, retry_after=max(1, int(min(self.lock_timeout, 30))))

    def _unlock(self) -> None:
        self._file_lock.release()
        self._thread_lock.release()

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

    def _swap_to(self, session: Session) -> Lease:
        state = self.store.read_state()
        keep = state.get("active_key") == session.key
        lost = self._slot_lost(state, trust_connection=keep)
        if keep and not lost:
            metrics.SWAPS.labels("none").inc()
            return Lease(session, HIT)
        started = time.monotonic()
        made_by = self.current_made_by()
        if state.get("active_persistent") and state.get("active") and not lost:
            self._save(state["active"], state["active_stem"], made_by, kind="session",
                       system_hash=state.get("active_system_hash"))
        restoring_off = fingerprint_key(made_by) in state.get("restore_disabled", {})
        cache, restored, restored_stem = self._load(session, made_by, restoring_off)
        self.store.write_state({**state, "active": session.id, "active_key": session.key,
                                "active_stem": session.stem,
                                "active_persistent": session.persistent,
                                "active_system_hash": session.system_hash,
                                "slot_tokens": restored, "updated_at": now_iso()})
        swap_ms = (time.monotonic() - started) * 1000
        log.info("swap to session=%s source=%s cache=%s restored_tokens=%d swap_ms=%.1f",
                 session.id, session.source, cache, restored, swap_ms)
        return Lease(session, cache, restored, swap_ms, restored_stem, made_by)

    def _slot_lost(self, state: dict, trust_connection: bool = False) -> bool:
        """True when llama-server no longer holds what the state file says (it restarted).

        With ``trust_connection``, a connection still open since the last slot
        call counts as proof that it did not, and ``/slots`` is not asked. Only
        the no-swap path trusts it: were llama-server behind another proxy, the
        connection could outlive a restart, and the worst outcome must be one
        prefill, never an emptied slot saved over a session's file.
        """
        expected = int(state.get("slot_tokens") or 0)
        if expected <= 0 or (trust_connection and self.client.same_server_as_last_slot_call()):
            return False
        try:
            slots = self.client.slots()
        except (UpstreamError, UpstreamUnavailable):
            return False
        for slot in slots:
            if slot.get("id") == self.slot_id:
                return slot_is_empty(slot)
        return False

    def _save(self, session_id: str, stem: str, made_by: dict, kind: str,
              system_hash: str | None) -> dict | None:
        started = time.monotonic()
        try:
            answer = self.client.slot_action(self.slot_id, "save", f"{stem}.bin")
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("could not save session %s: %s", session_id, exc)
            return None
        save_ms = (answer.get("timings") or {}).get("save_ms", (time.monotonic() - started) * 1000)
        metrics.observe_swap("save", time.monotonic() - started, answer.get("n_written", 0))
        sidecar = self.store.update_sidecar(
            stem, {"session_id": session_id, "kind": kind},
            session_id=session_id, kind=kind, system_hash=system_hash, made_by=made_by,
            n_tokens=answer.get("n_saved"), n_bytes=answer.get("n_written"),
            save_ms=round(save_ms, 2), saved_at=now_iso(), refused=None)
        self._evict(keep={stem})
        return sidecar

    def _evict(self, keep: set[str]) -> None:
        """Keep the slot folder within its bound, oldest files first."""
        if not self.max_disk_bytes:
            return
        keep = keep | {self.store.read_state().get("active_stem")}
        for stem, size in self.store.evict(self.max_disk_bytes, keep):
            log.info("evicted %s.bin (%d bytes): the slot folder is over its bound", stem, size)
            metrics.observe_eviction(size)

    def _restorable(self, stem: str, made_by: dict) -> dict | None:
        """The sidecar of a file that may be restored into this llama-server, else None."""
        if not self.store.has_bin(stem):
            return None
        sidecar = self.store.read_sidecar(stem)
        if not sidecar or not sidecar.get("saved_at"):
            log.warning("not restoring %s.bin: it has no sidecar saying what made it", stem)
            return None
        if sidecar.get("made_by") != made_by:
            reason = f"made by {sidecar.get('made_by')}, running {made_by}"
            log.warning("not restoring %s.bin: %s", stem, reason)
            self.store.update_sidecar(stem, {}, refused=reason, refused_at=now_iso())
            metrics.RESTORE_MISSES.labels("model_mismatch").inc()
            return None
        return sidecar

    def _load(self, session: Session, made_by: dict,
              restoring_off: bool) -> tuple[str, int, str | None]:
        """Fill the slot for ``session``: its own file, else a base snapshot, else empty."""
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
        return MISS, 0, None

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
        bound, self.lock_timeout = self.lock_timeout, timeout
        try:
            self._lock()
        except SlotBusy:
            return False
        finally:
            self.lock_timeout = bound
        try:
            state = self.store.read_state()
            if not (state.get("active_persistent") and state.get("active")) or self._slot_lost(state):
                return False
            return self._save(state["active"], state["active_stem"], self.current_made_by(),
                              kind="session", system_hash=state.get("active_system_hash")) is not None
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.warning("could not save the active session at shutdown: %s", exc)
            return False
        finally:
            self._unlock()

    def forget(self, session_id: str) -> bool:
        """Delete a session's (or base snapshot's) files; erase the slot if it holds it."""
        stems = {s["stem"] for s in self.store.sidecars() if s.get("session_id") == session_id}
        stems.add(Session(session_id, "admin").stem)  # a file left without its sidecar
        self._lock()
        try:
            state = self.store.read_state()
            if state.get("active") == session_id:
                self._erase()
                self.store.write_state({**state, "active": DEFAULT_SESSION, "active_key": None,
                                        "active_stem": None,
                                        "active_persistent": False, "active_system_hash": None,
                                        "slot_tokens": 0, "updated_at": now_iso()})
            removed = [self.store.delete(stem) for stem in stems]
            return any(removed)
        finally:
            self._unlock()

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
        before = dict(state)
        if timings:
            state["slot_tokens"] = cache_n + prompt_n + predicted_n
        if lease.cache in (RESTORED, BASE) and timings:
            self._verify_restore(lease, cache_n, state)
        if state != before:
            self.store.write_state(state)
        if not session.persistent:
            return
        self.store.update_sidecar(session.stem, {"session_id": session.id, "kind": "session"},
                                  count="hits", session_id=session.id, last_used_at=now_iso(),
                                  last_cache=lease.cache, last_cache_n=cache_n,
                                  last_prompt_n=prompt_n)
        if lease.cache == MISS and self.base_snapshots and session.system_hash and timings:
            self._save_base(session.system_hash, lease.made_by or self.current_made_by())

    def _save_base(self, system_hash: str, made_by: dict) -> None:
        """Snapshot a system prompt's first answer, unless this model already has one."""
        stem = base_stem(system_hash)
        sidecar = self.store.read_sidecar(stem)
        if self.store.has_bin(stem) and sidecar and sidecar.get("made_by") == made_by:
            return
        if self._save(f"base:{system_hash}", stem, made_by, kind="base", system_hash=system_hash):
            metrics.SWAPS.labels("base").inc()

    def _verify_restore(self, lease: Lease, cache_n: int, state: dict) -> None:
        """Count restores that llama-server reported but did not use."""
        if lease.restored_tokens < MIN_TOKENS_TO_VERIFY:
            return
        honoured = cache_n >= lease.restored_tokens * HONOURED_SHARE
        misses = state.setdefault("restore_misses", {})
        key = fingerprint_key(lease.made_by or self.current_made_by())
        if honoured:
            misses.pop(key, None)
            return
        misses[key] = misses.get(key, 0) + 1
        metrics.RESTORE_MISSES.labels("not_honoured").inc()
        log.warning("restore of session %s not honoured: %d tokens restored, %d reused (%d in a row)",
                    lease.session.id, lease.restored_tokens, cache_n, misses[key])
        self.store.update_sidecar(lease.restored_stem, {}, restore_not_honoured_at=now_iso())
        if self.restore_miss_limit and misses[key] >= self.restore_miss_limit:
            state.setdefault("restore_disabled", {})[key] = now_iso()
            log.error("restoring switched off for this model after %d unhonoured restores; "
                      "it comes back when the model or llama-server build changes", misses[key])


def slot_is_empty(slot: dict) -> bool:
    """Whether a /slots entry shows a slot that lost its tokens.

    A freshly started llama-server lists the slot without ``id_task``; after a
    task, ``n_prompt_tokens`` is the number of tokens the slot holds.
    """
    return "id_task" not in slot or not slot.get("n_prompt_tokens")
