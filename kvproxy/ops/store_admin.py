"""The shared store's admin action: a sweep of unreferenced chunks, run now (flask-smorest).

The same sweep the nodes run every KVPROXY_STORE_SWEEP_MINUTES, under the same lease: when
another node holds it, the answer says which and until when, and nothing is swept here.
"""
from __future__ import annotations

import marshmallow as ma
from flask import current_app
from flask.views import MethodView
from flask_smorest import Blueprint, abort

from kvproxy import routes

blueprint = Blueprint("store", __name__, description="The shared session store")


class SweepSchema(ma.Schema):
    swept = ma.fields.Boolean(metadata={
        "description": "False when another node held the sweep lease (then nothing was swept)"})
    holder = ma.fields.String(allow_none=True, metadata={
        "description": "The node that held the lease, when another did"})
    until = ma.fields.Float(allow_none=True, metadata={
        "description": "Its lease's expiry, seconds since the epoch"})
    checked = ma.fields.Integer(metadata={"description": "Chunks listed in the bucket"})
    deleted = ma.fields.Integer(metadata={
        "description": "Chunks deleted: those no session object named, older than the grace "
                       "period, and those only the conversations the size budget evicted named"})
    freed_bytes = ma.fields.Integer(metadata={
        "description": "Bytes deleted: those chunks and the evicted session objects"})
    seconds = ma.fields.Float()
    problem = ma.fields.String(allow_none=True, metadata={
        "description": "Why the sweep stopped before deleting everything it chose"})
    evicted = ma.fields.Integer(metadata={
        "description": "Conversations (session objects) evicted to keep KVPROXY_STORE_MAX_GB, "
                       "the least recently saved first; nodes keep their local copies"})
    evicted_chunks = ma.fields.Integer(metadata={
        "description": "Of the chunks deleted, those only the evicted conversations named"})
    evicted_bytes = ma.fields.Integer(metadata={
        "description": "Of the bytes freed, those the size budget evicted"})
    stored_bytes = ma.fields.Integer(metadata={
        "description": "Bytes of chunks and session objects in the bucket before the sweep"})
    budget_bytes = ma.fields.Integer(metadata={
        "description": "The size budget (KVPROXY_STORE_MAX_GB) in bytes; 0: none"})


class Sweep(MethodView):
    @blueprint.response(200, SweepSchema)
    def post(self):
        """Sweep the shared store now: delete the chunks no session object names that are
        older than KVPROXY_STORE_SWEEP_GRACE_SECONDS and, over KVPROXY_STORE_MAX_GB, evict
        the least recently saved conversations, if this node can take the sweep lease.
        A store that fails answers 503 and nothing more is deleted."""
        shared = current_app.extensions.get("kvproxy.shared_store")
        if shared is None:
            abort(409, message="no shared store: KVPROXY_STORE_URL is not set")
        return shared.sweep().record()


routes.add_rules(blueprint, globals())
