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
        "description": "Chunks no session object named, older than the grace period, deleted"})
    freed_bytes = ma.fields.Integer()
    seconds = ma.fields.Float()
    problem = ma.fields.String(allow_none=True, metadata={
        "description": "Why the sweep stopped before deleting every chunk it chose"})


class Sweep(MethodView):
    @blueprint.response(200, SweepSchema)
    def post(self):
        """Sweep the shared store now: delete the chunks no session object names that are
        older than KVPROXY_STORE_SWEEP_GRACE_SECONDS, if this node can take the sweep lease.
        A store that fails answers 503 and nothing more is deleted."""
        shared = current_app.extensions.get("kvproxy.shared_store")
        if shared is None:
            abort(409, message="no shared store: KVPROXY_STORE_URL is not set")
        return shared.sweep().record()


routes.add_rules(blueprint, globals())
