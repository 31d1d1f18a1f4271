"""The parts the settings describe, built one way for the app and for ``kvproxy doctor``.

The app factory (``kvproxy.create_app``) and the operator's tools (``kvproxy.ops``) both
build llama-server clients and slot switches from the settings; building them here keeps
ops/ from importing the app factory, which imports ops/ for its routes.
"""
from __future__ import annotations

import dataclasses

from kvproxy.config import Settings
from kvproxy.slots.switch import SlotSwitch, SwitchSettings
from kvproxy.storage.shared.store import SharedStore
from kvproxy.storage.store import SessionStore
from kvproxy.upstream.llama import LlamaClient


def llama_client(settings: Settings) -> LlamaClient:
    """A client of llama-server with the settings' bounds and key."""
    return LlamaClient(settings.upstream, settings.connect_timeout, settings.read_timeout,
                       settings.slot_action_timeout, api_key=settings.upstream_api_key)


def shared_store(settings: Settings) -> SharedStore | None:
    """The shared store ``KVPROXY_STORE_URL`` names, None when it is off."""
    return SharedStore.of(settings)


def build_switch(settings: Settings, client: LlamaClient, store: SessionStore,
                 shared: SharedStore | None = None) -> SlotSwitch:
    """The slot switch the settings describe (the app's, and ``kvproxy doctor``'s, which
    uploads nothing: no ``shared``)."""
    return SlotSwitch(client, store, settings=dataclasses.replace(SwitchSettings.of(settings),
                                                                  shared=shared))
