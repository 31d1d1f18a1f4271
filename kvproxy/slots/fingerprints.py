"""llama-server's fingerprint (what made a slot file), known without holding up a swap.

A file is restored only into the llama-server that made it (``plan.same_maker``), so a swap
needs the running server's ``/props``, ``/v1/models`` and ``/lora-adapters``: small round
trips (the first two took a tenth of a small restore), kept in the server's view
(``upstream.view.ServerView.maker``). They change only when llama-server restarts, or when
its adapters' scales are set (``POST /lora-adapters``, which kvproxy relays and then
``forget``s them). While the connection of the last slot call before they were asked is
still open, it has not restarted (``LlamaClient.still_open``) and they are reused as they
are. Otherwise a swap may plan with the last ones while they are asked again beside it
(``for_swap``): a swap that only restores can be redone if they changed, one that would
write a file waits for them first (``plan.undoable``).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from kvproxy.slots.plan import fingerprint, model_of
from kvproxy.upstream.llama import LlamaClient
from kvproxy.upstream.view import Maker

# Longest wait for the fingerprint asked beside a swap: the client's own calls are bounded
# too (30 s read timeout), this only keeps a stuck thread from holding the slot longer.
CONFIRM_TIMEOUT_S = 60.0


class Fingerprints:
    """The running llama-server's fingerprint, asked as rarely as it can change."""

    def __init__(self, client: LlamaClient, kv_format: Callable[[], str | None]):
        self.client = client
        self.view = client.view
        self.kv_format = kv_format
        self._lock = threading.Lock()
        # One thread, one question at a time: swaps on several slots share the answer.
        self._asker: ThreadPoolExecutor | None = None
        self._asking: Future | None = None

    def now(self) -> dict:
        """The fingerprint, asked again unless llama-server provably did not restart."""
        facts = self.view.maker()
        if not self.view.proven(facts):
            facts = self._ask()
        return self._of(facts)

    def for_swap(self) -> tuple[dict, "Asking | None"]:
        """The fingerprint to plan a swap with, and, when nothing proves the last one still
        holds, the same to ask again while the swap runs (None: proven, or just asked)."""
        facts = self.view.maker()
        if facts is None:
            return self._of(self._ask()), None
        if self.view.proven(facts):
            return self._of(facts), None
        return self._of(facts), Asking(self)

    def proven_same(self) -> bool:
        """Whether llama-server provably is the process the fingerprint was asked of (the
        connection of the last slot call before it is still open)."""
        return self.view.proven(self.view.maker())

    def forget(self) -> None:
        """Ask again before the next swap: llama-server changed (restarted, or its LoRA
        adapters were set)."""
        self.view.forget_maker()

    def last_model(self) -> str | None:
        """The tag of the model in the last fingerprint asked (None before the first)."""
        facts = self.view.maker()
        return model_of(self._of(facts)) if facts else None

    def _submit(self) -> Future:
        with self._lock:
            if self._asking is not None and not self._asking.done():
                return self._asking
            if self._asker is None:
                self._asker = ThreadPoolExecutor(1, thread_name_prefix="kvproxy-fingerprint")
            self._asking = self._asker.submit(lambda: self._of(self._ask()))
            return self._asking

    def _ask(self) -> Maker:
        return self.view.ask_maker()

    def _of(self, facts: Maker) -> dict:
        return fingerprint(facts.props, facts.models, self.kv_format(), facts.adapters)


class Asking:
    """The fingerprint asked again beside a swap: started when the swap's restore starts
    (``start``; llama-server answers it while restoring), so it does not compete with the
    swap's own work before that."""

    def __init__(self, fingerprints: Fingerprints):
        self._fingerprints = fingerprints
        self._asked: Future | None = None

    def start(self) -> None:
        if self._asked is None:
            self._asked = self._fingerprints._submit()

    def changed(self, planned: dict) -> dict | None:
        """The fingerprint when it differs from the one ``planned`` with (the swap must then
        be redone); None when it is the same. Raises what asking raised."""
        self.start()
        fresh = self._asked.result(timeout=CONFIRM_TIMEOUT_S)
        return fresh if fresh != planned else None
