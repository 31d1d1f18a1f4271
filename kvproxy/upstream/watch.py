"""Closing a whole answer's upstream request when its client leaves.

A non-streamed answer gives kvproxy nothing to write until llama-server is done, so a client
that left is only noticed by asking (``still_wanted``). One watcher thread asks every running
call a few times a second and shuts the connection of a call whose client left: llama-server
sees it close and stops the task, which frees the slot. One thread for all calls, started
once: a thread per call cost the no-swap path more than the rest of kvproxy's bookkeeping.
It goes on asking while calls come, and sleeps after ``IDLE_AFTER`` seconds without one.

To know which connection carries a call, the ``requests`` session mounts ``CuttableAdapter``:
its urllib3 connections note themselves on the calling thread's watch as they send.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

log = logging.getLogger("kvproxy.upstream")

# Seconds between two questions to a running call's client.
WATCH_EVERY = 0.25
# Seconds without a call to watch after which the thread sleeps until the next one.
IDLE_AFTER = 60.0

_calling = threading.local()  # the watch of the call this thread is making, if any


class Watch:
    """One call another thread may cut: the connection it runs on, and whether it was cut."""

    def __init__(self, still_wanted: Callable[[], bool]) -> None:
        self.still_wanted = still_wanted
        self.connection: HTTPConnection | None = None
        self.cut = False
        self.finished = False
        self.lock = threading.Lock()

    def cut_now(self) -> bool:
        """Shut the call's connection down: llama-server sees it close and stops the task.
        False while there is nothing to cut yet (still connecting)."""
        with self.lock:
            if self.finished:
                return True
            sock = getattr(self.connection, "sock", None)
            if sock is None:
                return False
            self.cut = True
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return True

    def finish(self) -> None:
        with self.lock:
            self.finished = True


class _Watcher:
    """The one thread that asks every watched call's client whether it is still there."""

    def __init__(self) -> None:
        self._watches: set[Watch] = set()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._asleep = False

    def add(self, watch: Watch) -> None:
        """Watch ``watch`` from the next round on. Waking the thread costs the calling
        request a thread switch, so it is woken only from its sleep after ``IDLE_AFTER``."""
        with self._changed:
            self._watches.add(watch)
            if self._asleep:
                self._asleep = False
                self._changed.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvproxy-client-watch",
                                                daemon=True)
                self._thread.start()

    def remove(self, watch: Watch) -> None:
        with self._changed:
            self._watches.discard(watch)

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._changed:
                self._changed.wait(WATCH_EVERY)  # a call is first asked about after a while
                if self._watches:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > IDLE_AFTER:
                    self._asleep = True
                    while self._asleep:
                        self._changed.wait()
                    continue
                watches = list(self._watches)
            for watch in watches:
                try:
                    if not watch.finished and not watch.still_wanted() and watch.cut_now():
                        self.remove(watch)
                except Exception:  # one bad question must not end the watching of the rest
                    log.exception("asking whether a client is still there failed")


_watcher = _Watcher()


@contextmanager
def cut_when_gone(still_wanted: Callable[[], bool]) -> Iterator[Watch]:
    """Watch the call this thread makes inside the block; its ``cut`` says whether it was
    cut because its client left."""
    watch = Watch(still_wanted)
    _calling.watch = watch
    _watcher.add(watch)
    try:
        yield watch
    finally:
        _calling.watch = None
        watch.finish()
        _watcher.remove(watch)


class _Noted:
    """A urllib3 connection that tells the watch of the calling thread it carries the call."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        watch = getattr(_calling, "watch", None)
        if watch is not None:
            watch.connection = self
        return super().request(*args, **kwargs)


class _NotedHTTPConnection(_Noted, HTTPConnection):
    pass


class _NotedHTTPSConnection(_Noted, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _NotedHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _NotedHTTPSConnection


class CuttableAdapter(HTTPAdapter):
    """requests' adapter whose connections can be found, and cut, by the watcher."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
