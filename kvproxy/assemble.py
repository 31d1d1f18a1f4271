"""The parts the settings describe, built one way for the app and for ``kvproxy doctor``.

The app factory (``kvproxy.create_app``) and the operator's tools (``kvproxy.ops``) both
build llama-server clients and slot switches from the settings; building them here keeps
ops/ from importing the app factory, which imports ops/ for its routes.
"""
from __future__ import annotations

import dataclasses
import os

from kvproxy.config import ConfigError, Settings
from kvproxy.slots.switch import SlotSwitch, SwitchSettings
from kvproxy.storage.chunks.hot import HotCopies
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


def hot_copies(settings: Settings) -> HotCopies | None:
    """The hot copies ``KVPROXY_HOT_DIR`` names (one per process, for every model's switch),
    None when they are off or the store keeps whole files."""
    if not settings.hot_dir or not settings.hot_gb or settings.session_store != "chunks":
        return None
    if os.path.realpath(settings.hot_dir) == os.path.realpath(settings.slot_dir):
        raise ConfigError("KVPROXY_HOT_DIR is the slot folder: point it at a folder of its own "
                          "in memory, such as /dev/shm/kvproxy-hot")
    try:
        return HotCopies(settings.hot_dir, int(settings.hot_gb * 1024**3))
    except OSError as exc:
        raise ConfigError(f"KVPROXY_HOT_DIR={settings.hot_dir!r} cannot be used: "
                          f"{exc.strerror or exc} (create it, or leave it empty to keep no hot "
                          f"copies)") from None


def build_switch(settings: Settings, client: LlamaClient, store: SessionStore,
                 shared: SharedStore | None = None, hot: HotCopies | None = None) -> SlotSwitch:
    """The slot switch the settings describe (the app's, and ``kvproxy doctor``'s, which
    uploads nothing and keeps no hot copies: no ``shared``, no ``hot``)."""
    return SlotSwitch(client, store, settings=dataclasses.replace(SwitchSettings.of(settings),
                                                                  shared=shared, hot=hot))
