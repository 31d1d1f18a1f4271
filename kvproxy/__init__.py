"""kvproxy: a session-aware front door for llama-server, one conversation per slot."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from flask import Flask
from flask_smorest import Api

from kvproxy.config import Settings, check_slot_dir, load_settings
from kvproxy.web.common import FreeHeldSlots, see_sent_replies
from kvproxy.upstream.llama import LlamaClient
from kvproxy.relay.relay import Relay
from kvproxy.ops.startup import Contract
from kvproxy.storage.store import SessionStore
from kvproxy.slots.models import ModelSwitches
from kvproxy.slots.switch import SlotSwitch

__version__ = "0.1.0"


def build_switch(settings: Settings, client: LlamaClient, store: SessionStore) -> SlotSwitch:
    """The slot switch the settings describe (the app's, and ``kvproxy doctor``'s)."""
    return SlotSwitch(client, store, settings.slot_id,
                      settings.lock_timeout, settings.base_snapshots,
                      settings.restore_miss_limit, int(settings.max_disk_gb * 1024**3),
                      int(settings.min_free_gb * 1024**3),
                      max_waiters=settings.max_waiters,
                      restore_off_minutes=settings.restore_off_minutes,
                      slots=settings.slots, save_behind=settings.save_behind,
                      save_behind_delay=settings.save_behind_delay,
                      slot_keep=settings.slot_keep)


def create_app(config: Mapping[str, Any] | Settings | None = None) -> Flask:
    """Build the app: settings, the slot switch, dialect blueprints, admin API.

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
    client = LlamaClient(settings.upstream, settings.connect_timeout, settings.read_timeout,
                         settings.slot_action_timeout, api_key=settings.upstream_api_key)
    def make_switch(client: LlamaClient, store: SessionStore) -> SlotSwitch:
        return build_switch(settings, client, store)
    switch = make_switch(client, SessionStore(settings.slot_dir))
    models = ModelSwitches(client, switch, make_switch)
    app.extensions["kvproxy.switch"] = switch
    app.extensions["kvproxy.models"] = models
    # Its own client: the probe must not count as the last slot call of the switch's client,
    # whose open connection vouches for what the slot holds.
    app.extensions["kvproxy.contract"] = Contract(
        LlamaClient(settings.upstream, settings.connect_timeout, settings.read_timeout,
                    settings.slot_action_timeout, api_key=settings.upstream_api_key), switch)
    app.extensions["kvproxy.relay"] = Relay(settings, client, switch, models)
    app.wsgi_app = FreeHeldSlots(app.wsgi_app)

    from kvproxy.ops import admin, metrics, health as ops
    from kvproxy.web import body_limit, guard, users
    from kvproxy.web import anthropic, errors, llamacpp, ollama, openai, passthrough
    for blueprint in (ops.blueprint, openai.blueprint, ollama.blueprint, anthropic.blueprint,
                      llamacpp.blueprint, passthrough.blueprint):
        app.register_blueprint(blueprint)
    api = Api(app)
    api.register_blueprint(admin.blueprint)
    api.register_blueprint(admin.slots_blueprint)
    body_limit.init_app(app)
    app.before_request(admin.require_token)  # after the body limit, as the routes' own checks
    users.init_app(app)  # client API keys, where set
    guard.init_app(app)  # Host names, cross-site requests, admin content types
    app.before_request(see_sent_replies)  # admin and status reads see the replies sent
    errors.init_app(app, api)
    metrics.init_app(app)
    from kvproxy.ops import status  # GET /status and /api/status
    status.init_app(app, api)
    return app
