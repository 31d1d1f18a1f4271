"""How fast something went lately (units per second), so a choice between two ways to the
same result can be made on this machine's own figures: e.g. fetching a conversation's cache
from the shared store, or computing its prompt again.

An exponentially weighted mean of recent runs' speeds. Runs shorter than ``least_units`` are
left out (their fixed costs hide the speed); unknown (None) until one was seen.
"""
from __future__ import annotations

import threading


class Pace:
    """Units per second of recent runs (``note``), newest weighing ``weight`` of the whole."""

    def __init__(self, least_units: float = 1.0, weight: float = 0.3):
        self.least_units = least_units
        self.weight = weight
        self._rate: float | None = None
        self._lock = threading.Lock()

    def note(self, units: float, seconds: float) -> None:
        """A run did ``units`` in ``seconds``; too short a run teaches nothing."""
        if units < self.least_units or seconds <= 0:
            return
        rate = units / seconds
        with self._lock:
            self._rate = rate if self._rate is None else \
                self.weight * rate + (1 - self.weight) * self._rate

    def rate(self) -> float | None:
        with self._lock:
            return self._rate

    def seconds_for(self, units: float) -> float | None:
        """How long ``units`` would take at the recent pace (None: not known yet)."""
        rate = self.rate()
        return units / rate if rate else None
