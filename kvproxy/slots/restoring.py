"""Restoring a saved file into a slot, or refusing it: how a saved session comes back.

``restore`` has the store put the file where llama-server reads it (``SessionFiles.staged``)
and asks llama-server to restore it; a file llama-server refuses is remembered in its sidecar
with the server that refused it (``plan.remember_refusal``). ``refuse`` carries out the plan's
refusal of a file (``plan.restore_problem``): logged, counted, set aside or noted in its
sidecar. The executor's, as ``saving.SlotSaver`` is for saves (the caller holds the slot).
"""
from __future__ import annotations

import logging
import time

from kvproxy.errors import StorageError
from kvproxy.slots import plan
from kvproxy.slots.plan import Refuse
from kvproxy.storage.session_files import SessionFiles
from kvproxy.storage.store import SessionStore, now_iso
from kvproxy.telemetry import metrics
from kvproxy.upstream.llama import LlamaClient, UpstreamError

log = logging.getLogger("kvproxy.switch")


class SlotRestorer:
    """Restores files of the store into slots, and refuses those the plan refused."""

    def __init__(self, client: LlamaClient, store: SessionStore, files: SessionFiles):
        self.client = client
        self.store = store
        self.files = files

    def restore(self, stem: str, slot: int, made_by: dict | None = None,
                saved_at: str | None = None) -> tuple[int, float] | None:
        """Restore ``<stem>.bin`` into ``slot``: the tokens restored and llama-server's time for
        it (the lease records both in the sidecar after the answer), None when it failed.
        A file llama-server refuses (``plan.remember_refusal``) is remembered in its sidecar
        with the server that refused it, so it is not offered to that server again and a
        refused base is made afresh (only the save ``saved_at``: one put in place since was
        not refused)."""
        started = time.monotonic()
        try:
            with self.files.staged(stem) as name:
                answer = self.client.slot_action(slot, "restore", name)
        except StorageError as exc:   # not put together: llama-server was not asked
            log.warning("restore of %s failed: %s", stem, exc)
            metrics.RESTORE_MISSES.labels("failed").inc()
            return None
        except UpstreamError as exc:  # a failed restore wipes the slot; erase keeps it clean
            log.warning("restore of %s.bin failed: %s", stem, exc.message)
            metrics.RESTORE_MISSES.labels("failed").inc()
            if plan.remember_refusal(exc.status, made_by):
                self.store.update_sidecar(stem, {}, of_save=saved_at, refused=exc.message,
                                          refused_at=now_iso(), refused_by=made_by)
            return None
        restore_ms = (answer.get("timings") or {}).get("restore_ms",
                                                       (time.monotonic() - started) * 1000)
        metrics.observe_swap("restore", time.monotonic() - started, answer.get("n_read", 0))
        return int(answer.get("n_restored") or 0), float(restore_ms)

    def refuse(self, refused: Refuse) -> None:
        """A file the plan does not restore: why, in the log; set aside, noted in its sidecar
        and counted as the plan says."""
        stem, reason = refused.stem, refused.reason
        if refused.quarantine:
            log.warning("not restoring %s.bin: %s; %s, the session starts fresh",
                        stem, reason, self.files.set_aside(stem, reason))
        elif refused.metric == "too_big":
            log.warning("not restoring %s.bin: %s (llama-server would fail and wipe the slot); "
                        "the session starts fresh", stem, reason)
        else:
            log.warning("not restoring %s.bin: %s", stem, reason)
        if refused.record:
            self.store.update_sidecar(stem, {}, of_save=refused.saved_at, refused=reason,
                                      refused_at=now_iso())
        if refused.metric:
            metrics.RESTORE_MISSES.labels(refused.metric).inc()
