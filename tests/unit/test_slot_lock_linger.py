"""A slot freed by this process keeps its file lock a moment (slots/lock.py, LINGER_S): the
next request of this process takes only the thread lock, another process gets the slot once
the lock has lingered, or at once when it asked for it, and a slot in use never loses its
file lock."""
from __future__ import annotations

import time

import filelock
import pytest

from kvproxy.slots import lock as lock_module
from kvproxy.slots.lock import LINGER_S, TICK_S, SlotLock


@pytest.fixture
def slot_lock(tmp_path):
    return SlotLock(tmp_path / ".kvproxy.lock", timeout=5, max_waiters=4)


def other_process(slot_lock: SlotLock) -> filelock.FileLock:
    """Another process's lock on the same file (flock: another open file conflicts)."""
    return filelock.FileLock(str(slot_lock.path), thread_local=False)


def counting(slot_lock: SlotLock, monkeypatch) -> list[int]:
    calls = []
    take = slot_lock._file_lock.acquire

    def counted(*args, **kwargs):
        calls.append(1)
        return take(*args, **kwargs)
    monkeypatch.setattr(slot_lock._file_lock, "acquire", counted)
    return calls


def test_the_next_request_of_this_process_takes_only_the_thread_lock(slot_lock, monkeypatch):
    calls = counting(slot_lock, monkeypatch)
    assert slot_lock.try_acquire()
    slot_lock.release()
    assert slot_lock.try_acquire()
    slot_lock.release()
    slot_lock.acquire()
    slot_lock.release()
    assert len(calls) == 1


def test_another_process_waits_for_the_lingering_lock_then_gets_it(slot_lock):
    slot_lock.acquire()
    slot_lock.release()
    other = other_process(slot_lock)
    with pytest.raises(filelock.Timeout):
        other.acquire(timeout=0)          # lingering: this process still holds the file
    started = time.monotonic()
    other.acquire(timeout=LINGER_S * 2 + 5)  # freed by the releaser thread, not by the test
    waited = time.monotonic() - started
    assert waited < LINGER_S * 2 + 5
    assert not slot_lock.try_acquire()    # now the other process has the slot
    other.release()
    assert slot_lock.try_acquire()


def test_a_slot_in_use_or_used_lately_keeps_its_file_lock(slot_lock):
    slot_lock.acquire()
    assert not slot_lock.free_file_lock(idle=0)      # held by a thread of this process
    slot_lock.release()
    assert not slot_lock.free_file_lock(idle=60)     # freed a moment ago
    assert slot_lock.free_file_lock(idle=0)
    other = other_process(slot_lock)
    other.acquire(timeout=0)
    other.release()


def test_a_slot_taken_again_while_its_lock_is_being_freed_holds_the_file_again(slot_lock):
    slot_lock.acquire()
    slot_lock.release()
    assert slot_lock.free_file_lock(idle=0)
    assert slot_lock.try_acquire()
    other = other_process(slot_lock)
    with pytest.raises(filelock.Timeout):
        other.acquire(timeout=0)


def test_a_failure_to_free_the_file_lock_does_not_stop_the_releaser(slot_lock, monkeypatch,
                                                                     caplog):
    def broken():
        raise OSError("I/O error")
    slot_lock.acquire()
    monkeypatch.setattr(slot_lock._file_lock, "release", broken)
    slot_lock.release()
    deadline = time.monotonic() + LINGER_S * 4 + 5
    while slot_lock in lock_module._releaser._lingering and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slot_lock not in lock_module._releaser._lingering
    assert any("freeing the file lock" in r.getMessage() for r in caplog.records)


def test_freeing_never_waits_for_a_request_that_waits_for_another_process(slot_lock):
    """A request waiting for another process's file lock holds the guard; the releaser
    passes this slot by (and frees the other slots' locks) instead of waiting behind it."""
    slot_lock.acquire()
    slot_lock.release()
    with slot_lock._file_guard:
        started = time.monotonic()
        assert not slot_lock.free_file_lock(idle=0)
        assert time.monotonic() - started < 1
    assert slot_lock.free_file_lock(idle=0)


def another_process_slot_lock(slot_lock: SlotLock) -> SlotLock:
    """Another kvproxy process's lock on the same slot (its own open file: flock conflicts)."""
    return SlotLock(slot_lock.path, timeout=5, max_waiters=4)


def test_a_lingering_lock_asked_for_is_freed_at_the_holders_next_release(slot_lock):
    """Under steady use the lock never idles LINGER_S: the other process's ask is what lets
    it in, at the holder's next release, as if nothing lingered."""
    other = another_process_slot_lock(slot_lock)
    slot_lock.acquire()
    slot_lock.release()
    assert slot_lock.try_acquire()        # this process's next request: the lock lingered
    assert not other.try_acquire()        # the other process finds it taken, and asks
    assert other.asked_path.exists()
    slot_lock.release()
    assert other.try_acquire()            # freed by that release, not by the releaser
    assert not other.asked_path.exists()  # the ask was answered
    assert not slot_lock.try_acquire()
    other.release()


def test_an_idle_lingering_lock_asked_for_is_freed_at_the_releasers_next_look(slot_lock):
    """The releaser looks every TICK_S: an ask frees a lock that lingered less than LINGER_S."""
    other = another_process_slot_lock(slot_lock)
    slot_lock.acquire()
    slot_lock.release()
    assert not slot_lock.free_file_lock()   # nobody asked yet, freed a moment ago
    assert not other.try_acquire()
    assert slot_lock.free_file_lock()       # asked: freed without lingering on
    assert other.try_acquire()
    other.release()


def test_an_unanswered_ask_does_not_free_a_lock_in_use(slot_lock):
    other = another_process_slot_lock(slot_lock)
    assert slot_lock.try_acquire()
    assert not other.try_acquire()
    assert not slot_lock.free_file_lock()   # in use: the release answers the ask
    assert not other.try_acquire()
    slot_lock.release()
    assert other.try_acquire()
    other.release()


def test_without_an_ask_a_release_keeps_the_file_lock(slot_lock):
    slot_lock.acquire()
    slot_lock.release()
    assert not slot_lock.asked_path.exists()
    assert not slot_lock.free_file_lock()   # freed a moment ago, nobody asked
    with pytest.raises(filelock.Timeout):
        other_process(slot_lock).acquire(timeout=0)


def test_a_folder_that_takes_no_marker_still_frees_the_lock_after_lingering(slot_lock,
                                                                            monkeypatch):
    other = another_process_slot_lock(slot_lock)
    monkeypatch.setattr(other, "asked_path", slot_lock.path.parent / "missing" / "x.asked")
    slot_lock.acquire()
    slot_lock.release()
    assert not other.try_acquire()          # the ask fails quietly
    assert other.acquire(timeout=LINGER_S + TICK_S * 4 + 5) is True
    other.release()


def test_after_an_ask_every_release_lets_the_file_lock_go_for_a_while(slot_lock, monkeypatch):
    """The waiting process asks at each of its looks; meanwhile this process's requests
    free the file lock at each release, not only the first one after the ask."""
    other = another_process_slot_lock(slot_lock)
    slot_lock.acquire()
    assert not other.try_acquire()
    slot_lock.release()
    slot_lock.acquire()                   # this process's next request takes the file again
    slot_lock.release()                   # and lets it go again: asked a moment ago
    assert other.try_acquire()
    other.release()
    monkeypatch.setattr(lock_module, "ASKED_S", 0.05)
    slot_lock.acquire()
    assert not other.try_acquire()
    slot_lock.release()                   # asked: let go
    time.sleep(0.1)                       # nobody asked since: lingering resumes
    slot_lock.acquire()
    slot_lock.release()
    with pytest.raises(filelock.Timeout):
        other_process(slot_lock).acquire(timeout=0)


@pytest.mark.timeout(30)
def test_a_process_looking_every_poll_gets_in_between_another_ones_steady_requests(slot_lock):
    """This process serves requests back to back (5 ms each, 5 ms apart); another one looks
    for the slot every 0.1 s, as the pool does, and gets it within a few looks."""
    import threading
    other = another_process_slot_lock(slot_lock)
    stop = threading.Event()

    def steady_requests():
        while not stop.is_set():
            slot_lock.acquire()
            time.sleep(0.005)
            slot_lock.release()
            time.sleep(0.005)
    serving = threading.Thread(target=steady_requests)
    serving.start()
    try:
        looks = 0
        while not other.try_acquire():
            looks += 1
            assert looks < 50, "the other process never got the slot"
            time.sleep(0.1)
        other.release()
    finally:
        stop.set()
        serving.join(timeout=5)


def test_a_request_waiting_for_another_process_asks_at_each_look_until_its_bound(slot_lock,
                                                                                monkeypatch):
    """A blocking take (housekeeping, the start-up checks) asks every TICK_S, not once: a
    holder answers an ask for ASKED_S only, and its slot may stay busy longer."""
    other = another_process_slot_lock(slot_lock)
    asks = []
    ask = other._ask_for_file_lock
    monkeypatch.setattr(other, "_ask_for_file_lock", lambda: (asks.append(1), ask()))
    assert slot_lock.try_acquire()          # in use all along: it never lets go
    with pytest.raises(lock_module.SlotBusy):
        other.acquire(timeout=TICK_S * 3.5)
    assert len(asks) >= 3
    slot_lock.release()                     # the last ask is answered at this release
    assert other.acquire(timeout=5) is False   # free at once: it did not wait
    other.release()
