"""The slot switch of each model llama-server serves.

A llama-server started with one model (``-m``) has one switch: the app's. Started
as a router (``--models-dir`` / ``--models-preset``; its ``/props`` says ``role:
router``), it runs each model in a llama-server of its own, with slots of its
own, and loads and unloads them on demand. Then each model gets its own switch:
a client whose every call names the model, and a state table and slot locks in
the shared slot folder that carry the model's tag (files carry it anyway).

Loading a model may unload another (``--models-max``), and an unload loses what
its slots hold. So before a request makes the router load a model, the turns the
other models' slots hold and their files lack are saved; when an unloaded model
comes back its slots are empty, and its conversations are restored from their files.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from kvproxy.errors import ClientError
from kvproxy.sessions.identity import model_tag
from kvproxy.slots.state import SlotTable
from kvproxy.slots.switch import SlotSwitch
from kvproxy.storage.store import SessionStore
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable
from kvproxy.upstream.view import is_loaded, pick_model  # noqa: F401 - imported from here too

log = logging.getLogger("kvproxy.switch")

SAVE_BEFORE_LOAD_S = 30  # at most this long for another model's slot to be free to save


class ModelSwitches:
    """Which switch and client serve a request's model."""

    def __init__(self, client: LlamaClient, switch: SlotSwitch,
                 make_switch: Callable[[LlamaClient, SessionStore], SlotSwitch]):
        self.client = client              # the server's (the router's in router mode)
        self.default = switch             # the one switch of a one-model server
        self._make_switch = make_switch
        self.view = client.view           # what llama-server says of itself, cached
        self._switches: dict[str, SlotSwitch] = {}
        self._lock = threading.Lock()

    # -- the server's mode and models (its view: ``upstream.view``) --------------------
    def is_router(self) -> bool:
        """Whether llama-server is a router of several models (asked once it answers)."""
        return self.view.is_router()

    def entries(self, fresh: bool = False) -> list[dict]:
        """The router's models (``/v1/models``), each with its status; cached briefly."""
        return self.view.entries(fresh)

    def resolve(self, requested: object) -> str:
        """The router's id for the model a request names; a 404 names the models there are."""
        model = pick_model(requested, self.entries())
        if model is None:
            names = ", ".join(e["id"] for e in self.entries())
            raise ClientError(f"model '{requested}' not found; llama-server serves: {names}", 404)
        return model

    def switches(self) -> list[SlotSwitch]:
        """Every switch in use: the default one, then one per model that was asked for."""
        with self._lock:
            return [self.default, *self._switches.values()]

    # -- a request's route -------------------------------------------------------------
    def route(self, requested: object) -> tuple[SlotSwitch, LlamaClient]:
        """The switch and client for a request naming ``requested``. Behind a router, the
        other models' unsaved turns are saved first when this model is not loaded."""
        if not self.is_router():
            return self.default, self.client
        model = self.resolve(requested)
        switch = self.switch_for(model)
        entry = next((e for e in self.entries(fresh=True) if e["id"] == model), None)
        if not is_loaded(entry):
            self.save_others(model)
        return switch, switch.client

    def switch_for(self, model: str) -> SlotSwitch:
        with self._lock:
            switch = self._switches.get(model)
            if switch is None:
                client = self.client.for_model(model)
                store = self.default.store.for_model(model_tag(model))
                switch = self._switches[model] = self._make_switch(client, store)
                self._share(switch)
            return switch

    def _share(self, switch: SlotSwitch) -> None:
        """What every model's switch keeps in common with the default one: deletions (a
        session's spans every model), the recent activity and dropped saves (the status page,
        /health and the command line read the default switch's), and the pins of files swaps
        are about to restore (one folder: no model's eviction deletes another's)."""
        switch.deletions = self.default.deletions
        switch.activity = self.default.activity
        switch.budget.dropped = self.default.budget.dropped
        switch.budget.share_pins(self.default.budget)

    def serving(self, loaded_only: bool = False) -> list[SlotSwitch]:
        """The switches whose slots kvproxy drives: behind a router one per model asked for
        since start (``loaded_only``: of those the router has loaded now), else the one."""
        if not self.is_router():
            return [self.default]
        with self._lock:
            switches = dict(self._switches)
        if loaded_only:
            loaded = {e["id"] for e in self.entries(fresh=True) if is_loaded(e)}
            switches = {m: s for m, s in switches.items() if m in loaded}
        return list(switches.values())

    def slot_listing(self) -> list[dict]:
        """Every slot kvproxy drives (``SlotSwitch.slot_listing``), behind a router each
        naming its model. Asks llama-server nothing once it is known."""
        if not self.is_router():
            return self.default.slot_listing()
        return [{**row, "model": switch.client.model}
                for switch in self.serving() for row in switch.slot_listing()]

    def forget(self, session_id: str) -> bool:
        """Delete a session on every model: behind a router, each model's slots holding it are
        emptied (erased where the router has the model loaded), then its files of every model
        go. False when it had no file."""
        if not self.is_router():
            return self.default.forget(session_id)
        try:
            entries = self.entries(fresh=True)
        except (UpstreamError, UpstreamUnavailable):  # its files still go, as with one model
            with self._lock:
                entries = [{"id": model} for model in self._switches]  # none known loaded
        with self.default.deletions.deleting(session_id):
            for entry in entries:
                switch = self._holding(entry["id"], session_id)
                if switch is not None:
                    switch.empty_slots_of(session_id, loaded=is_loaded(entry))
            return self.default.delete_files(session_id)

    def _holding(self, model: str, session_id: str) -> SlotSwitch | None:
        """The switch of ``model`` when it has one, or when its state table names the session
        (a model kvproxy has not used since it started may still hold it in a slot)."""
        with self._lock:
            switch = self._switches.get(model)
        if switch is None:
            table = SlotTable(SessionStore(self.default.store.root, model=model_tag(model)))
            if any(state.session_id == session_id for state in table.read().values()):
                switch = self.switch_for(model)
        return switch

    def save_others(self, model: str) -> None:
        """Save what the other models' slots hold and their files lack: loading ``model`` may
        unload them."""
        for other, switch in list(self._switches.items()):
            if other == model:
                continue
            saved = switch.checkpoint(SAVE_BEFORE_LOAD_S, unsaved_only=True)
            if saved:
                log.info("saved the unsaved turns of model %s before loading %s", other, model)
