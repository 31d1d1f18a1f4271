"""Saving a conversation's new turns in the background, once its slot has settled.

Without it a slot is saved only when another session takes it (the save is then
on that request's critical path) and at a graceful stop, so a crash of
llama-server or kvproxy loses every turn since the last swap. After each answer
of a persistent session the switch arms its slot here; when the slot has stayed
idle ``delay`` seconds, the switch saves it (``SlotSwitch.save_settled``) if it
is free right then, holding it like any slot action. Arming again before that
moves the time on, so a burst of turns (a tool round trip) is saved once. A slot
that is busy when its time comes is left alone: the request holding it arms it
again when it ends.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("kvproxy.switch")


class SaveBehind:
    """One daemon thread that saves armed slots when they are due."""

    def __init__(self, save: Callable[[int], object], delay: float):
        self._save = save
        self.delay = delay
        self._due: dict[int, float] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.saved = 0   # background saves made, for tests and the log

    def arm(self, slot: int) -> None:
        """Save ``slot`` once it has been idle ``delay`` seconds from now."""
        with self._cond:
            armed = slot in self._due
            self._due[slot] = time.monotonic() + self.delay
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvproxy-save-behind",
                                                daemon=True)
                self._thread.start()
            if not armed:
                # Armed again, the slot is due later than the thread's wake-up, which then
                # waits on: waking it now would cost this request a thread switch.
                self._cond.notify()

    def pending(self) -> set[int]:
        with self._cond:
            return set(self._due)

    def _next_due(self) -> int:
        """Wait for the next slot whose time has come, and take it off the list."""
        with self._cond:
            while True:
                now = time.monotonic()
                if self._due:
                    slot, due = min(self._due.items(), key=lambda item: item[1])
                    if due <= now:
                        del self._due[slot]
                        return slot
                    self._cond.wait(due - now)
                else:
                    self._cond.wait()

    def _run(self) -> None:
        while True:
            slot = self._next_due()
            try:
                if self._save(slot):
                    self.saved += 1
            except Exception:  # a background save must never end the thread
                log.exception("saving slot %d in the background failed", slot)
