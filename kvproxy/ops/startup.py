"""Start-up: clean the slot folder and prove the contract with llama-server.

kvproxy and llama-server must agree on things neither checks by itself: the
slot folder kvproxy reads is the one llama-server writes, llama-server has slot
saving on, and the slot id exists (llama-server wraps ids modulo its slot
count, so a wrong id silently lands on another slot). A probe save proves the
first two. When llama-server is up at start, a mismatch stops start-up with one
line; when it is not up yet, ``/health`` runs the check lazily and reports a
mismatch (503 with the reason) until it passes.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Iterator

from kvproxy.storage import model_names
from kvproxy.errors import ContractError  # imported from here too
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable
from kvproxy.errors import StateFormatError, StorageError
from kvproxy.storage.store import PROBE_PREFIX, unlink_with_companions
from kvproxy.slots.restore_probe import ProbeVerdict, prove_restores

log = logging.getLogger("kvproxy.startup")

START_WAIT = 30      # seconds start-up waits for the slot (another process may hold it)
RECHECK_AFTER = 5    # seconds between lazy re-checks from /health while not passed


def sweep_slot_folder(switch, wait: float = START_WAIT) -> list[str]:
    """Remove leftovers of crashes from the slot folder, with every slot locked, and write an
    older state file in the current format; logs each action."""
    with switch.holding(wait) as held:
        if not held:
            log.warning("start-up sweep of the slot folder skipped: a slot stayed busy")
            return []
        try:
            done = model_names.tag_old_files(switch.store)
            done += switch.files.sweep()   # the folder's, and its chunks' and hot copies'
            if switch.store.migrate_state_file():
                done.append(f"state file migrated to the per-slot table (its slot is "
                            f"{switch.store.legacy_slot})")
        except StateFormatError as exc:
            raise ContractError(str(exc)) from None
        except (OSError, StorageError) as exc:
            log.warning("start-up sweep of the slot folder failed: %s", exc)
            return []
    for line in done:
        log.info("start-up sweep: %s", line)
    return done


def contract_problem(client: LlamaClient, switch) -> str | None:
    """Why kvproxy and llama-server disagree, or None. Run with the slot locked.

    Raises UpstreamUnavailable, or UpstreamError for a 5xx, when llama-server
    cannot answer yet. llama-server started with ``--api-key`` refusing kvproxy's key
    (``/props`` and ``/health`` answer without one, ``/slots`` does not) is a mismatch.
    """
    try:
        for _check, problem in contract_checks(client, switch):
            if problem:
                return problem
    except UpstreamError as exc:
        if getattr(exc, "unauthorized", False):
            return f"llama-server {exc.message}"
        raise
    return None


def contract_checks(client: LlamaClient, switch) -> Iterator[tuple[str, str | None]]:
    """Each check of the contract in turn, as (check, problem or None), up to the first
    problem: ``slots`` (count and id), ``slot listing``, ``slot saving``, ``slot folder``;
    nothing behind a router. Run with the slot locked; ``kvproxy doctor`` prints each one.

    Raises UpstreamUnavailable, or UpstreamError for a 5xx, when llama-server
    cannot answer yet.
    """
    slot_id, root = switch.slot_id, switch.store.root
    props = client.view.fresh_props()
    if props.get("role") == "router":
        return  # several models, each with slots of its own: see slots.models
    total = props.get("total_slots")
    wanted = switch.configured_slots
    if isinstance(total, int) and wanted > 1 and wanted > total:
        yield "slots", (f"KVPROXY_SLOTS={wanted}, but llama-server has {total} slot(s): start it "
                        f"with -np {wanted}, or set KVPROXY_SLOTS to {total} or less (0: as many "
                        "as it has)")
        return
    slot_id = switch.slot_ids()[0]
    if isinstance(total, int) and slot_id >= total:
        yield "slots", (f"KVPROXY_SLOT_ID={slot_id}, but llama-server has {total} slot(s) (ids 0 "
                        f"to {total - 1}) and would wrap the id onto another slot: set "
                        f"KVPROXY_SLOT_ID below {total}")
        return
    yield "slots", None
    try:
        client.slots()
    except UpstreamError as exc:
        if exc.status == 501:   # --no-slots: slot actions still work, the listing does not
            yield "slot listing", ("llama-server does not list its slots (started with "
                                   "--no-slots), and kvproxy needs GET /slots to know what each "
                                   "slot holds: start it without --no-slots")
            return
        if exc.status >= 500:
            raise
    yield "slot listing", None
    name = f"{PROBE_PREFIX}{secrets.token_hex(8)}.bin"
    try:
        client.slot_action(slot_id, "save", name)
    except UpstreamError as exc:
        if exc.status == 501:
            yield "slot saving", f"llama-server has slot saving off: start it with --slot-save-path {root}"
            return
        if exc.status >= 500:
            raise
        yield "slot saving", f"llama-server refused a probe save into slot {slot_id}: {exc.message}"
        return
    yield "slot saving", None
    probe = root / name
    if not probe.is_file():
        yield "slot folder", (f"llama-server saved its probe file {name} outside "
                              f"KVPROXY_SLOT_DIR={root}: start llama-server with --slot-save-path "
                              f"{root}, or set KVPROXY_SLOT_DIR to its folder (and delete {name} "
                              "there)")
        return
    unlink_with_companions(probe)   # and a newer llama-server's probe.<hex>.bin.ckpt
    yield "slot folder", None


class Contract:
    """The start-up check's outcome; passes once, re-checked lazily until then."""

    def __init__(self, client: LlamaClient, switch):
        self.client = client
        self.switch = switch
        self.passed = False
        self.problem: str | None = None
        self.restore_verdict: ProbeVerdict | None = None  # the restore probe's, once run
        self._checked_at = float("-inf")
        self._checking = threading.Lock()

    def verify(self, wait: float) -> str | None:
        """Run the check with the slot locked (waiting at most ``wait`` s; a busy slot
        leaves it pending). Returns the mismatch, or None when it passed or is pending.
        Raises UpstreamUnavailable/UpstreamError when llama-server cannot answer."""
        self._checked_at = time.monotonic()
        with self.switch.holding(wait) as held:
            if not held:
                return None
            problem = contract_problem(self.client, self.switch)
            # the answer contract_problem just asked (a problem stops before it is needed)
            router = problem is None and self.client.view.props().get("role") == "router"
            if problem is None and not self.passed and not router:
                self.restore_verdict = prove_restores(self.switch, self.client)
        if problem and problem != self.problem:
            log.error("start-up check failed: %s", problem)
        elif not problem and router:
            log.info("start-up check passed: llama-server is a router of several models; "
                     "each model's slots are driven apart, its files in %s", self.switch.store.root)
        elif not problem:
            log.info("start-up check passed: llama-server writes slot files into %s; "
                     "kvproxy drives slot(s) %s", self.switch.store.root, self.switch.slot_ids())
        self.problem, self.passed = problem, problem is None
        return problem

    def current_problem(self) -> str | None:
        """For /health, without waiting: the known mismatch. Until the check passes, it is
        run again in the background, at most every few seconds."""
        if not self.passed and time.monotonic() - self._checked_at >= RECHECK_AFTER and \
                self._checking.acquire(blocking=False):
            self._checked_at = time.monotonic()
            threading.Thread(target=self._recheck, name="kvproxy-startup-check", daemon=True).start()
        return self.problem

    def _recheck(self) -> None:
        try:
            self.verify(wait=0)
        except (UpstreamError, UpstreamUnavailable) as exc:
            log.info("start-up check pending: %s", exc)
        except Exception:  # a background check must never die silently
            log.exception("start-up check failed unexpectedly")
        finally:
            self._checking.release()


def check_at_start(app) -> None:
    """Sweep the slot folder, have the shared store (if any) catch up with it in the
    background and start its periodic sweeps, then run the check; a mismatch raises ContractError. llama-server not
    answering yet leaves the check to /health."""
    sweep_slot_folder(app.extensions["kvproxy.switch"])
    shared = app.extensions.get("kvproxy.shared_store")
    if shared is not None:
        shared.catch_up(app.extensions["kvproxy.switch"].files)
        shared.start_sweeps()
    contract: Contract = app.extensions["kvproxy.contract"]
    try:
        problem = contract.verify(wait=START_WAIT)
    except (UpstreamError, UpstreamUnavailable) as exc:
        log.warning("llama-server does not answer yet (%s); /health reports the start-up check "
                    "until it passes", exc)
        return
    if problem:
        raise ContractError(problem)
