"""kvproxy: a session-aware front door for llama-server, one conversation per slot."""
from __future__ import annotations

import importlib
import logging
from typing import Any, Mapping

from flask import Flask
from flask_smorest import Api, Blueprint as ApiBlueprint

from kvproxy import routes
from kvproxy.assemble import build_switch, hot_copies, llama_client, shared_store
from kvproxy.config import Settings, check_slot_dir, load_settings
from kvproxy.ops.startup import Contract
from kvproxy.slots.models import ModelSwitches
from kvproxy.slots.switch import SlotSwitch
from kvproxy.storage.store import SessionStore
from kvproxy.upstream.llama import LlamaClient
from kvproxy.version import __version__
from kvproxy.web.common import FreeHeldSlots
from kvproxy.relay.relay import Relay

__all__ = ["__version__", "create_app"]


def create_app(config: Mapping[str, Any] | Settings | None = None) -> Flask:
    """Build the app: settings, the slot switch, the route table's blueprints, the gate.

    ``config`` is a dict of setting overrides (tests) or ready Settings;
    everything else comes from ``KVPROXY_*`` environment variables.
    """
    settings = config if isinstance(config, Settings) else load_settings(overrides=config)
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("kvproxy").setLevel(settings.log_level)

    app = Flask(__name__)
    app.config.update(
        KVPROXY=settings,
        API_TITLE="kvproxy admin API", API_VERSION=__version__, OPENAPI_VERSION="3.0.3",
        OPENAPI_URL_PREFIX="/api", OPENAPI_JSON_PATH="openapi.json",
        OPENAPI_SWAGGER_UI_PATH=None)
    app.json.sort_keys = False
    app.json.compact = True

    check_slot_dir(settings.slot_dir)
    client = llama_client(settings)

    shared = shared_store(settings)   # one per process, for every model's switch
    hot = hot_copies(settings)        # likewise

    def make_switch(client: LlamaClient, store: SessionStore) -> SlotSwitch:
        return build_switch(settings, client, store, shared, hot)
    switch = make_switch(client, SessionStore(settings.slot_dir))
    models = ModelSwitches(client, switch, make_switch)
    app.extensions["kvproxy.switch"] = switch
    app.extensions["kvproxy.models"] = models
    app.extensions["kvproxy.shared_store"] = shared
    # Its own client: the probe must not count as the last slot call of the switch's client,
    # whose open connection vouches for what the slot holds.
    app.extensions["kvproxy.contract"] = Contract(llama_client(settings), switch)
    app.extensions["kvproxy.relay"] = Relay(settings, client, switch, models)
    app.wsgi_app = FreeHeldSlots(app.wsgi_app)

    api = Api(app)
    for blueprint in blueprints():
        (api if isinstance(blueprint, ApiBlueprint) else app).register_blueprint(blueprint)
    from kvproxy.ops import metrics, status
    from kvproxy.web import errors, gate
    gate.init_app(app, settings)  # the one check before every request
    errors.init_app(app, api)
    metrics.init_app(app)
    return app


def blueprints() -> list:
    """The blueprints the route table names (``routes.BLUEPRINTS``), in its order."""
    found = []
    for where in routes.BLUEPRINTS.values():
        module, _, attribute = where.partition(":")
        found.append(getattr(importlib.import_module(module), attribute))
    return found
