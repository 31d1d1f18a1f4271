"""Operator endpoints: /health and /metrics, and the X-KVProxy-Node header on every reply."""
from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify
from prometheus_client import generate_latest, CONTENT_TYPE_LATEST

from kvproxy import routes
from kvproxy.upstream.llama import UpstreamError, UpstreamUnavailable
from kvproxy.telemetry.metrics import REGISTRY

blueprint = Blueprint("ops", __name__)


@blueprint.record_once
def name_the_node(state) -> None:
    """Behind a balancer, operators and tests see which machine answered (and holds the
    session): every reply names it, the name taken from the settings once."""
    node = state.app.config["KVPROXY"].node_name

    def header(response: Response) -> Response:
        response.headers["X-KVProxy-Node"] = node
        return response
    state.app.after_request(header)


def health() -> Response:
    """200 with llama-server's state when it answers, 503 otherwise, or while the start-up
    check finds that kvproxy and llama-server disagree (the reason is in ``error``). A
    problem with the slot folder's disk (a save dropped lately, less free space than the
    floor) is ``status: degraded`` with the reason in ``disk``, still 200; so is a shared
    store that cannot be written (the reason in ``store``: sessions are still served from the
    slot folder, and their uploads wait)."""
    client = current_app.extensions["kvproxy.relay"].client
    try:
        upstream = client.health()
    except (UpstreamError, UpstreamUnavailable) as exc:
        response = jsonify({"status": "unavailable", "upstream": client.base_url,
                            "error": str(exc)})
        response.status_code = 503
        return response
    contract = current_app.extensions["kvproxy.contract"]
    problem = contract.current_problem()
    if problem:
        response = jsonify({"status": "misconfigured", "upstream": client.base_url,
                            "error": problem, "llama_server": upstream})
        response.status_code = 503
        return response
    # A disk problem degrades kvproxy (sessions are computed afresh), it does not stop it:
    # still 200, so a balancer keeps sending it traffic.
    disk_problem = current_app.extensions["kvproxy.switch"].budget.problem()
    shared = current_app.extensions.get("kvproxy.shared_store")
    store_problem = shared.problem() if shared is not None else None
    return jsonify({"status": "degraded" if disk_problem or store_problem else "ok",
                    "upstream": client.base_url, "llama_server": upstream,
                    "startup_check": "passed" if contract.passed else "pending",
                    **({"disk": disk_problem} if disk_problem else {}),
                    **({"store": store_problem} if store_problem else {})})


def metrics() -> Response:
    """Prometheus text format."""
    return Response(generate_latest(REGISTRY), mimetype=CONTENT_TYPE_LATEST)


routes.add_rules(blueprint, globals())
