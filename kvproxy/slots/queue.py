"""Pure decisions of the waiting queue: who goes first, and which slot is kept for whom.

``SlotPool`` holds the facts (who waits, until when, how often each was overtaken, which slot
is kept for which conversation until when) and only locks and waits; these functions decide
over them (see ``pool``'s docstring for the rules as a whole). No I/O, no clock: every time
is given.
"""
from __future__ import annotations

from dataclasses import dataclass

# A new conversation overtaken this many times by returning ones is not overtaken again.
MAX_OVERTAKEN = 16


@dataclass(eq=False)
class Waiter:
    """One request of this process waiting for a slot (its ``overtaken`` count grows)."""

    key: str | None
    side: bool
    short: bool = False
    deadline: float = float("inf")  # time.monotonic() at which its wait for a slot ends
    overtaken: int = 0

    def new(self) -> bool:
        """A new conversation (a whole prefill): neither a side request nor a short turn."""
        return not self.side and not self.short

    def honours_keeps(self, keep_until: float = 0.0) -> bool:
        """A new conversation leaves kept slots alone, unless overtaken ``MAX_OVERTAKEN``
        times already or a keep until ``keep_until`` would outlast its wait; returning
        conversations and side requests do not."""
        return self.new() and self.overtaken < MAX_OVERTAKEN and keep_until < self.deadline


@dataclass(frozen=True)
class Kept:
    """A slot kept for the next turn of the conversation ``key`` until ``until``."""

    key: str
    until: float


@dataclass(frozen=True)
class Join:
    """Where a waiter joins the queue, and the waiters it passes (each overtaken once more)."""

    index: int
    passed: tuple[Waiter, ...] = ()


def join(queue: list[Waiter], short: bool, counts: bool = True) -> Join:
    """Where a new waiter joins ``queue``: at the end, except that a short one (a returning
    conversation) goes before the new conversations at the end of the queue that were
    overtaken less than ``MAX_OVERTAKEN`` times (each of them counts one more, unless not
    ``counts``: a slot is serving new conversations meanwhile, so they are not held up)."""
    index = len(queue)
    while short and index > 0 and not queue[index - 1].short \
            and queue[index - 1].overtaken < MAX_OVERTAKEN:
        index -= 1
    return Join(index, tuple(queue[index:]) if counts else ())


def serving_order(queue: list[Waiter], several_slots: bool, serving_new: bool) -> list[Waiter]:
    """The queue in the order placement serves it: with several slots and none running a new
    conversation that waited (``serving_new``), the first new conversation waiting goes
    first. So one slot keeps taking new conversations, one at a time, while the others serve
    returning turns: their prefill fills the machine while users pause, and a returning turn
    waits for other short turns, not behind a whole prefill."""
    order = list(queue)
    if several_slots and not serving_new:
        first_new = next((w for w in order if w.new()), None)
        if first_new is not None:
            order.remove(first_new)
            order.insert(0, first_new)
    return order


def live_keeps(kept: dict[int, Kept], now: float) -> dict[int, Kept]:
    """The keeps that have not run out at ``now``."""
    return {slot: keep for slot, keep in kept.items() if keep.until > now}


def keep_on_give_back(keep_for: str | None, keep_seconds: float, now: float,
                      kept: dict[int, Kept], max_kept: int, queue: list[Waiter]) -> Kept | None:
    """Whether a slot given back by the conversation ``keep_for`` is kept for its next turn:
    only while new conversations wait that would leave it alone (with none waiting there is
    nothing to keep it from, and one that comes later takes it at once), and at most
    ``max_kept`` slots at once (all but one of several), so new conversations keep moving."""
    until = now + keep_seconds
    if keep_for is None or keep_seconds <= 0 or len(live_keeps(kept, now)) >= max_kept:
        return None
    if not any(waiter.honours_keeps(until) for waiter in queue):
        return None
    return Kept(keep_for, until)


def overtaken_by_take(taker: Waiter, kept: Kept | None, serving_new: bool,
                      queue: list[Waiter]) -> list[Waiter]:
    """The waiters a take overtook: a slot taken by the conversation it was kept for while
    new conversations waited overtook each of them (unless a slot serves new ones)."""
    if kept is None or kept.key != taker.key or serving_new:
        return []
    return [waiter for waiter in queue if waiter is not taker and waiter.honours_keeps()]


def keeps_needed(queue: list[Waiter]) -> bool:
    """Whether anyone waiting leaves kept slots alone: with nobody, the keeps end."""
    return any(waiter.honours_keeps() for waiter in queue)
