"""The thread that asks clients of whole answers whether they are still there."""
from __future__ import annotations

import threading

from kvproxy.upstream import watch
from tests.support import wait_until


def test_calls_are_watched_without_waking_the_thread_until_it_sleeps_idle(monkeypatch):
    """Waking the watcher costs each call a thread switch: while calls come it asks them on
    its own rounds, and only a call after ``IDLE_AFTER`` without any wakes it."""
    monkeypatch.setattr(watch, "WATCH_EVERY", 0.01)
    monkeypatch.setattr(watch, "IDLE_AFTER", 0.2)
    watcher = watch._Watcher()
    woken = []
    notify = watcher._changed.notify
    monkeypatch.setattr(watcher._changed, "notify", lambda *a: (woken.append(1), notify(*a)))

    for _ in range(3):
        asked = threading.Event()
        call = watch.Watch(lambda: asked.set() or True)
        watcher.add(call)
        assert asked.wait(5)
        watcher.remove(call)
    assert woken == []

    wait_until(lambda: watcher._asleep)
    asked = threading.Event()
    call = watch.Watch(lambda: asked.set() or True)
    watcher.add(call)
    assert asked.wait(5)
    assert woken == [1]
    watcher.remove(call)
