"""kvproxy with parts of its no-swap path cut out, for ``bench.overhead --without``.

Not a configuration anyone runs: it measures how far the ratio to the bare relay can fall
when a part costs nothing. ``session``: every request gets the session the first one resolved
(no hashing, scoping or trail matching). ``slot``: every request reuses the first one's lease
(no pool, lock, swap check or bookkeeping after the answer). The rest of the path (the web
layer's hooks, parsing, the upstream call, the JSON reply) is kvproxy's as it ships.

gunicorn runs it as ``bench.overhead_without:build()``, with the parts to cut in
``KVPROXY_BENCH_WITHOUT`` (comma-separated).
"""
from __future__ import annotations

import os

PARTS = ("session", "slot")


def named_parts(text: str) -> tuple[str, ...]:
    """The parts a comma-separated list names; ValueError for a name not in ``PARTS``."""
    named = tuple(part for part in text.split(",") if part)
    unknown = [part for part in named if part not in PARTS]
    if unknown:
        raise ValueError(f"no part named {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    return named


def build():
    """kvproxy's WSGI app with the parts ``KVPROXY_BENCH_WITHOUT`` names cut out."""
    try:
        parts = set(named_parts(os.environ.get("KVPROXY_BENCH_WITHOUT", "")))
    except ValueError as exc:
        raise SystemExit(f"bench.overhead_without: {exc}") from None
    from kvproxy.relay.relay import Relay
    from kvproxy.slots.switch import SlotSwitch
    cut(parts, Relay, SlotSwitch)
    from kvproxy.wsgi import app
    return app


def cut(parts: set[str], relay_class: type, switch_class: type) -> None:
    """Replace the named parts' methods on ``relay_class`` (``Relay``) and ``switch_class``
    (``SlotSwitch``) with ones that repeat the first request's result."""
    if "session" in parts:
        relay_class.session_for = _first_answer(relay_class.session_for)
    if "slot" in parts:
        acquire, release = switch_class.acquire, switch_class.release
        first: list = []

        def reused_lease(switch, session, **kwargs):
            if not first:   # a real swap and release, then the same lease every time
                first.append(acquire(switch, session, **kwargs))
                release(switch, first[0])
            return first[0]
        switch_class.acquire = reused_lease
        switch_class.release = lambda switch, lease, timings=None: None


def _first_answer(method):
    """``method``, answering every call with what it answered the first."""
    answers: list = []

    def first(*args, **kwargs):
        if not answers:
            answers.append(method(*args, **kwargs))
        return answers[0]
    return first
