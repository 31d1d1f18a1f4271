"""Session admin API (flask-smorest): list, inspect, clear and delete sessions; list slots.

When ``KVPROXY_ADMIN_TOKEN`` is set every admin route needs ``Authorization: Bearer
<token>``, and the listing takes a user's key too (the route table's auth, checked by
``kvproxy.web.gate``). Failures are raised and answered by ``kvproxy.web.errors`` in
flask-smorest's shape.
"""
from __future__ import annotations

import marshmallow as ma
from flask import current_app
from flask.views import MethodView
from flask_smorest import Blueprint, abort

from kvproxy import routes
from kvproxy.sessions.identity import owns
from kvproxy.web import users

blueprint = Blueprint("sessions", __name__, description="Saved llama-server slot sessions")
slots_blueprint = Blueprint("slots", __name__,
                            description="The llama-server slots kvproxy drives")


class SessionSchema(ma.Schema):
    session_id = ma.fields.String(metadata={"description": "The id as the client sent it"})
    kind = ma.fields.String(metadata={"description": "'session', or 'base' for a shared system prompt"})
    file = ma.fields.String(metadata={
        "description": "The session's own file in the slot folder: <stem>.bin (the whole slot "
                       "file) or <stem>.chunked (its manifest and the tail beyond its last chunk)"})
    file_bytes = ma.fields.Integer(metadata={
        "description": "Bytes the session's own file takes on disk (chunks, shared, apart)"})
    stored_as = ma.fields.String(allow_none=True, metadata={
        "description": "'chunks' or 'file' (KVPROXY_SESSION_STORE, or a file kept whole)"})
    chunks = ma.fields.Integer(allow_none=True, metadata={
        "description": "Stored as chunks: how many chunks its manifest names"})
    written_bytes = ma.fields.Integer(allow_none=True, metadata={
        "description": "Bytes its last save wrote to the store (new chunks and its own file)"})
    n_tokens = ma.fields.Integer(allow_none=True)
    n_bytes = ma.fields.Integer(allow_none=True, metadata={"description": "Bytes llama-server wrote"})
    created_at = ma.fields.String(allow_none=True)
    last_used_at = ma.fields.String(allow_none=True)
    saved_at = ma.fields.String(allow_none=True)
    save_ms = ma.fields.Float(allow_none=True)
    restore_ms = ma.fields.Float(allow_none=True)
    hits = ma.fields.Integer()
    restores = ma.fields.Integer(allow_none=True)
    system_hash = ma.fields.String(allow_none=True)
    refused = ma.fields.String(allow_none=True, metadata={
        "description": "Why the file was last refused for restore (made by another model, "
                       "or llama-server itself refused it)"})
    refused_at = ma.fields.String(allow_none=True)
    refused_by = ma.fields.Dict(allow_none=True, metadata={
        "description": "The llama-server (fingerprint) that refused the file: it is not offered "
                       "to that server again"})
    restore_not_honoured_at = ma.fields.String(allow_none=True, metadata={
        "description": "Last time llama-server recomputed the prompt after restoring this file"})
    last_cache = ma.fields.String(allow_none=True, metadata={
        "description": "hit, restored, base or miss, for the last request"})
    last_cache_n = ma.fields.Integer(allow_none=True, metadata={
        "description": "Prompt tokens the last request reused (a base snapshot its swap made "
                       "counts as computed)"})
    last_prompt_n = ma.fields.Integer(allow_none=True, metadata={
        "description": "Prompt tokens computed for the last request"})
    prefill_computed = ma.fields.Integer(allow_none=True, metadata={
        "description": "Base snapshots: tokens computed to make it (the system prompt alone)"})
    made_by = ma.fields.Dict(allow_none=True, metadata={
        "description": "Model, context size and build that wrote the file"})


class RestoreCheckSchema(ma.Schema):
    restoring_off = ma.fields.Boolean(metadata={
        "description": "True while restoring is switched off for the running model"})
    off_since = ma.fields.String(allow_none=True)
    off_until = ma.fields.String(allow_none=True, metadata={
        "description": "When restoring comes back on by itself (KVPROXY_RESTORE_OFF_MINUTES)"})
    misses_in_a_row = ma.fields.Integer(metadata={
        "description": "Restores in a row that llama-server did not honour"})
    last_miss_at = ma.fields.String(allow_none=True)
    cause = ma.fields.String(allow_none=True, metadata={
        "description": "While switched off: why llama-server does not honour restores, and the fix"})


class SlotSchema(ma.Schema):
    id = ma.fields.Integer(metadata={"description": "llama-server's slot id (id_slot)"})
    model = ma.fields.String(allow_none=True, metadata={
        "description": "Behind llama-server's router: the model whose slot it is"})
    session_id = ma.fields.String(metadata={"description": "The session the slot holds"})
    persistent = ma.fields.Boolean(metadata={
        "description": "False for side requests and 'default': nothing to save"})
    file = ma.fields.String(allow_none=True, metadata={"description": "Its slot file"})
    tokens = ma.fields.Integer(metadata={"description": "Tokens the slot holds, as last recorded"})
    n_ctx = ma.fields.Integer(allow_none=True, metadata={
        "description": "The slot's context (llama-server's -c split between slots), once seen"})
    busy = ma.fields.Boolean(metadata={"description": "A request of this process holds it now"})
    busy_since = ma.fields.String(allow_none=True)
    unproven = ma.fields.Boolean(metadata={
        "description": "A swap failed half-way: what it holds is not trusted until the next swap"})
    since = ma.fields.String(allow_none=True, metadata={
        "description": "When the slot last changed session (or size)"})
    last_used_at = ma.fields.String(allow_none=True, metadata={
        "description": "Last request: the least recently used idle slot is swapped out first"})


class SlotQuerySchema(ma.Schema):
    slot = ma.fields.Integer(load_default=None, validate=ma.validate.Range(min=0), metadata={
        "description": "One slot's id; default: every slot"})


class CurrentSchema(ma.Schema):
    slot = ma.fields.Integer(allow_none=True, metadata={
        "description": "The slot described: the one asked for, else the one used last"})
    slots = ma.fields.List(ma.fields.Nested(SlotSchema), metadata={
        "description": "Every slot and the session it holds"})
    session_id = ma.fields.String()
    persistent = ma.fields.Boolean()
    file = ma.fields.String(allow_none=True)
    file_exists = ma.fields.Boolean()
    file_bytes = ma.fields.Integer()
    session = ma.fields.Nested(SessionSchema, allow_none=True)
    restore_check = ma.fields.Nested(RestoreCheckSchema, metadata={
        "description": "The restore check (for the model it switched off, if any)"})


class ClearedSchema(ma.Schema):
    session_id = ma.fields.String()
    cleared = ma.fields.Boolean()
    slots = ma.fields.List(ma.fields.Integer(), metadata={"description": "The slots cleared"})


def _switch():
    return current_app.extensions["kvproxy.switch"]


def _models():
    """Every model's switch (one, unless llama-server is a router)."""
    return current_app.extensions["kvproxy.models"]


def _restore_check_status() -> dict:
    """Never waits for the slot, nor for llama-server: reads one small file."""
    return _switch().restore_check.status(None)


def _as_listing(sidecar: dict) -> dict:
    return {**sidecar, "file": _switch().store.saved_name(sidecar.get("stem"), sidecar)}


class Sessions(MethodView):
    @blueprint.response(200, SessionSchema(many=True))
    def get(self):
        """List every saved session and base snapshot, from their sidecars; asked with a
        user's API key instead of the admin token, that user's own only."""
        user = users.request_user()
        return [_as_listing(s) for s in _switch().store.sidecars()
                if user is None or owns(user, str(s.get("stem") or ""))]


def _slot_arg(slot: int | None) -> int | None:
    driven = sorted({one for switch in _models().serving() for one in switch.slot_ids()})
    if slot is not None and slot not in driven:
        abort(400, message=f"no slot {slot}: kvproxy drives slots {driven}")
    return slot


class Current(MethodView):
    @blueprint.arguments(SlotQuerySchema, location="query")
    @blueprint.response(200, CurrentSchema)
    def get(self, args):
        """The session a slot holds now (``?slot=N``; default: the slot used last), the status
        of its slot file, and every slot with its session in ``slots``."""
        store = _switch().store
        slots = _models().slot_listing()
        slot = _slot_arg(args.get("slot"))
        if slot is None and slots:
            slot = max(slots, key=lambda row: (row["last_used_at"] or row["since"] or "",
                                               -row["id"]))["id"]
        row = next((row for row in slots if row["id"] == slot),
                   {"session_id": "default", "persistent": False, "file": None})
        stem = row["file"][:-len(".bin")] if row["file"] else None
        sidecar = store.read_sidecar(stem) if stem else None
        return {"slot": slot, "slots": slots,
                "session_id": row["session_id"], "persistent": row["persistent"],
                "file": store.saved_name(stem, sidecar) if stem else None,
                "file_exists": bool(stem) and store.has_bin(stem),
                "file_bytes": store.bin_bytes(stem) if stem else 0,
                "session": _as_listing(sidecar) if sidecar else None,
                "restore_check": _restore_check_status()}


class Clear(MethodView):
    @blueprint.arguments(SlotQuerySchema, location="query")
    @blueprint.response(200, ClearedSchema)
    def post(self, args):
        """Save the session a slot holds, erase the slot and make 'default' its session:
        ``?slot=N`` for one slot, every slot by default (each waits like a request); behind a
        router, on every model it has loaded."""
        slot = _slot_arg(args.get("slot"))
        cleared = [one for switch in _models().serving(loaded_only=True)
                   if slot is None or slot in switch.slot_ids()
                   for one in switch.clear(slot)]
        return {"session_id": "default", "cleared": True, "slots": cleared}


class RestoreCheckReset(MethodView):
    @blueprint.response(200, RestoreCheckSchema)
    def post(self):
        """Turn restoring back on and forget unhonoured restores; does not wait for the slot."""
        _switch().restore_check.reset()
        return _restore_check_status()


class OneSession(MethodView):
    @blueprint.response(204)
    def delete(self, session_id: str):
        """Delete a session's slot files and sidecars, of every model; erases every slot that
        holds it."""
        if not _models().forget(session_id):
            abort(404, message=f"no saved session {session_id!r}")


class Slots(MethodView):
    @slots_blueprint.response(200, SlotSchema(many=True))
    def get(self):
        """Every slot kvproxy drives: the session it holds, its tokens, busy or idle and since
        when (behind a router, every model's). Read from the state tables; never waits for a
        slot or for llama-server."""
        return _models().slot_listing()


routes.add_rules(blueprint, globals())
routes.add_rules(slots_blueprint, globals())
