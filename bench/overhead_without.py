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


def build():
    """kvproxy's WSGI app with the parts ``KVPROXY_BENCH_WITHOUT`` names cut out."""
    parts = {part for part in os.environ.get("KVPROXY_BENCH_WITHOUT", "").split(",") if part}
    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"bench.overhead_without: no part named {', '.join(sorted(unknown))}")
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
