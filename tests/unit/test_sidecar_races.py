"""Readers and writers of one slot file and its sidecar, interleaved with a save being put in
place (issue 35, defect 5): a good file is never quarantined, a new sidecar is never
overwritten by one read before it, and a refusal of an old save never sticks to the new one.

Each interleaving is forced: a hook in the middle of one side starts the other in a thread
and gives it a moment. Without the stem's lock the other side runs right there; with it, it
waits. ``other_store`` runs the second side through another ``SessionStore`` of the same
folder, as a second process would: only the file lock keeps them apart there.
"""
from __future__ import annotations

import errno
import threading

import pytest

from kvproxy.errors import UpstreamError
from kvproxy.sessions.identity import Session
from kvproxy.slots import plan
from kvproxy.slots.executor import SlotExecutor
from kvproxy.slots.plan import Restore, SwapFacts
from kvproxy.slots.state import SlotState
from kvproxy.storage import checked_save, quarantine
from kvproxy.storage.folder import FolderFiles
from kvproxy.storage.store import QUARANTINE_DIR, SIDECAR_FORMAT, SessionStore, write_json_atomic

MADE_BY = {"model_path": "m.gguf", "n_ctx": 4096, "build_info": "b1"}
SEED = "conv-seed@m"
OLD, NEW = "2026-01-01T00:00:00.000+00:00", "2026-01-01T00:05:00.000+00:00"
MOMENT = 0.3   # how long one side lets the other run (it finishes in milliseconds)


def sidecar(size: int, saved_at: str) -> dict:
    return {"format": SIDECAR_FORMAT, "stem": SEED, "session_id": "seed", "kind": "session",
            "saved_at": saved_at, "saved_bytes": size, "made_by": MADE_BY, "n_tokens": 10}


def saved(store: SessionStore, size: int = 10) -> None:
    """The seed's file and sidecar, as its last save left them."""
    store.bin_path(SEED).write_bytes(b"o" * size)
    write_json_atomic(store.sidecar_path(SEED), sidecar(size, OLD))


def new_save(store: SessionStore, size: int = 20) -> dict:
    """A newer save of the seed, checked and waiting to be put in place (``checked_save.install``)."""
    checked_save.temp_path(store, SEED).write_bytes(b"n" * size)
    return sidecar(size, NEW)


def run_aside(target) -> threading.Thread:
    """Start ``target`` in a thread and give it a moment (it finishes unless it waits)."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(MOMENT)
    return thread


def the_new_save_is_whole(store: SessionStore) -> None:
    assert store.bin_path(SEED).read_bytes() == b"n" * 20
    assert store.read_sidecar(SEED)["saved_at"] == NEW
    assert quarantine.file_check(store, SEED) == (store.read_sidecar(SEED), None)
    assert not (store.root / QUARANTINE_DIR).exists(), "nothing was quarantined"


@pytest.fixture(params=["same_store", "other_store"])
def stores(request, tmp_path) -> tuple[SessionStore, SessionStore]:
    store = SessionStore(tmp_path)
    return store, store if request.param == "same_store" else SessionStore(tmp_path)


def test_a_fork_reading_its_seed_while_the_seeds_save_is_put_in_place_quarantines_nothing(
        stores, monkeypatch):
    """The seed's slot renames its new file in, then its sidecar. A fork judging the seed's
    file in between saw a file that does not match its (old) sidecar and moved the good new
    file to quarantine, leaving the seed a sidecar without a file."""
    store, fork_store = stores
    saved(store)
    refused: list = []

    def fork_swap_reads_the_seed() -> None:
        executor = SlotExecutor(None, fork_store, None, FolderFiles(fork_store))
        problem = plan.restore_problem(executor.facts.file_facts(SEED), MADE_BY, None, 0)
        refused.append(problem)
        if problem is not None:
            executor.restorer.refuse(problem)

    threads = []
    real_move = checked_save.move_companions

    def between_the_renames(src, dst, keep=None):   # the file is in, its sidecar not yet
        if not threads:
            threads.append(run_aside(fork_swap_reads_the_seed))
        return real_move(src, dst, keep)
    monkeypatch.setattr(checked_save, "move_companions", between_the_renames)

    checked_save.install(store, SEED, new_save(store))
    threads[0].join(10)
    assert refused == [None], "the fork finds the seed's new file whole and may restore it"
    the_new_save_is_whole(store)


def test_a_sidecar_update_read_before_a_save_is_not_written_over_the_new_sidecar(
        stores, monkeypatch):
    """``update_sidecar`` reads, changes and writes: a save put in place between its read and
    its write got the old sidecar back over its new one, and its good file was then
    quarantined by the next reader."""
    store, saver_store = stores
    saved(store)
    threads = []
    real_merged = store.merged_sidecar

    def read_then_the_save_lands(stem, defaults, **changes):
        read = real_merged(stem, defaults, **changes)
        if not threads:
            ready = new_save(saver_store)
            threads.append(run_aside(lambda: checked_save.install(saver_store, SEED, ready)))
        return read
    monkeypatch.setattr(store, "merged_sidecar", read_then_the_save_lands)

    store.update_sidecar(SEED, {}, count="restores", restore_ms=1.0)
    threads[0].join(10)
    the_new_save_is_whole(store)


def test_a_count_written_while_a_save_is_put_in_place_is_kept(stores, monkeypatch):
    """A save's sidecar is the one there with the save's fields laid over it. Built from the
    file before the stem's lock was taken, a hit an answer wrote in between was lost when the
    save's sidecar was renamed over it."""
    store, counter_store = stores
    saved(store)
    store.update_sidecar(SEED, {}, count="hits")
    threads = []
    real_beside = checked_save.write_json_beside

    def a_hit_lands(path, data):   # the save's sidecar is being written
        if not threads:
            threads.append(run_aside(lambda: counter_store.update_sidecar(SEED, {},
                                                                          count="hits")))
        return real_beside(path, data)
    monkeypatch.setattr(checked_save, "write_json_beside", a_hit_lands)

    installed = checked_save.install(store, SEED, new_save(store))
    threads[0].join(10)
    the_new_save_is_whole(store)
    assert installed["hits"] == 1, "the save's sidecar keeps the hit counted before it"
    assert store.read_sidecar(SEED)["hits"] == 2, "and the one counted while it was put in place"


def test_a_sidecar_that_cannot_be_read_as_a_save_is_put_in_place_keeps_the_old_pair(
        tmp_path, monkeypatch):
    store = SessionStore(tmp_path)
    saved(store)
    ready = new_save(store)

    def unreadable(stem, defaults, **changes):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(store, "merged_sidecar", unreadable)
    with pytest.raises(checked_save.SaveFailed, match="Input/output error"):
        checked_save.install(store, SEED, ready)
    monkeypatch.undo()
    assert not checked_save.temp_path(store, SEED).exists(), "the save is discarded"
    assert store.bin_path(SEED).read_bytes() == b"o" * 10
    assert store.read_sidecar(SEED)["saved_at"] == OLD


def test_a_file_judged_bad_that_is_whole_when_set_aside_is_kept(tmp_path):
    """A Refuse decided from a mismatch that a save has since replaced: the file now matches
    its sidecar and is not moved."""
    store = SessionStore(tmp_path)
    saved(store)
    note = quarantine.set_aside(store, SEED, "it has 20 bytes, its sidecar says 10")
    assert note.startswith("kept")
    assert store.bin_path(SEED).is_file() and quarantine.file_check(store, SEED)[1] is None
    assert not (tmp_path / QUARANTINE_DIR).exists()
    store.bin_path(SEED).write_bytes(b"short")      # a real mismatch still goes
    assert quarantine.set_aside(store, SEED, "short") == f"moved to {QUARANTINE_DIR}/"
    assert not store.bin_path(SEED).exists()


class RefusingRestore:
    """llama-server refusing a restore (400), while the file's owner puts a new save in place
    (the refusal was of the file as it was)."""

    def __init__(self, store: SessionStore):
        self.store = store

    def slot_action(self, slot, action, filename=None):
        checked_save.install(self.store, SEED, new_save(self.store))
        raise UpstreamError(400, "failed to restore slot: invalid file")


def test_a_refused_restore_is_not_recorded_on_a_save_put_in_place_since(tmp_path):
    """``refused_by`` keeps a file from ever being offered to that llama-server again: written
    on the sidecar of a newer save, it would lose that session's good file for good."""
    store = SessionStore(tmp_path)
    saved(store)
    executor = SlotExecutor(RefusingRestore(store), store, None, FolderFiles(store))
    session = Session("seed", "test")
    facts = SwapFacts(0, SlotState(), session, plan.UNASKED, MADE_BY,
                      own=executor.facts.file_facts(SEED))
    restores = [a for a in plan.plan_swap(facts) if isinstance(a, Restore)]
    assert [a.stem for a in restores] == [SEED]
    assert executor.carry_out(restores, MADE_BY, None, [0], set()).cache == plan.MISS
    assert "refused_by" not in store.read_sidecar(SEED)
    assert plan.restore_problem(executor.facts.file_facts(SEED), MADE_BY, None, 0) is None
    the_new_save_is_whole(store)


def test_a_sidecar_update_about_one_save_is_written_only_on_that_save(tmp_path):
    store = SessionStore(tmp_path)
    saved(store)
    store.update_sidecar(SEED, {}, of_save=OLD, refused="invalid", refused_by=MADE_BY)
    assert store.read_sidecar(SEED)["refused_by"] == MADE_BY
    assert store.update_sidecar(SEED, {}, of_save=NEW, refused="x") is None
    assert store.read_sidecar(SEED)["refused"] == "invalid"


def test_a_restore_carries_the_save_it_restored_to_the_notes_after_the_answer(tmp_path, fake):
    """The restore's notes (counters, time, restore check) go on the save that was restored:
    the lease knows its ``saved_at``, and a sidecar of a newer save does not take them."""
    from tests.fake_llama import make_switch
    from tests.support import A, B, turn
    switch = make_switch(tmp_path)
    turn(switch, A, fake)
    turn(switch, B, fake)
    lease = switch.acquire(A)
    assert lease.cache == plan.RESTORED
    assert lease.restored_saved_at == switch.store.read_sidecar(A.stem)["saved_at"]
    lease.restored_saved_at = OLD   # as if a newer save of the file were in place meanwhile
    lease.restored_stem = B.stem    # (a fork's seed: notes of another session's file)
    before = switch.store.read_sidecar(B.stem)
    switch.release(lease, {"cache_n": 12, "prompt_n": 1, "predicted_n": 0})
    assert switch.store.read_sidecar(B.stem) == before
