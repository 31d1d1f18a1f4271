"""The operator's view: ``GET /status`` (an HTML page) and ``GET /api/status`` (its data).

The page itself holds nothing private and loads without a token; its data
names sessions (ids can be e-mail addresses), so ``/api/status`` sits behind
the admin token like the rest of the admin API. The data is built by plain
functions from the slot folder, the switch's recent activity and a short,
bounded look at llama-server through its view (``ServerView.look``: a connection
of its own, never the one the switch uses to notice llama-server restarts).
"""
from __future__ import annotations

import shutil
from datetime import datetime, timezone
from flask import Blueprint as FlaskBlueprint, current_app, render_template, request
from flask.views import MethodView
from flask_smorest import Blueprint

from kvproxy import routes
from kvproxy.version import __version__
from kvproxy.storage.usage import folder_usage
from kvproxy.telemetry import metrics
from kvproxy.slots.restore_check import RestoreCheck
from kvproxy.storage.store import now_iso
from kvproxy.slots.switch import fingerprint, fingerprint_key
from kvproxy.upstream.view import ServerView

api_blueprint = Blueprint("status", __name__,
                          description="Everything the status page shows, in one call")
page_blueprint = FlaskBlueprint("status_page", __name__)


# No inline code, nothing from another origin: the page works offline and a
# hostile session id shown on it cannot run script.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
            "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


# -- pure views of what is on disk and in memory -------------------------------
def session_rows(sidecars: list[dict]) -> tuple[list[dict], list[dict]]:
    """Sidecars as the page's rows: (sessions, base snapshots), most recently used first."""
    sessions, bases = [], []
    for s in sidecars:
        row = {"id": s.get("session_id"),
               "file": f"{s.get('stem')}{'.chunked' if s.get('stored_as') == 'chunks' else '.bin'}",
               "bytes": s.get("file_bytes", 0), "tokens": s.get("n_tokens"),
               "last_used": s.get("last_used_at") or s.get("saved_at"),
               "restores": s.get("restores") or 0}
        if s.get("kind") == "base":
            row["system_hash"] = s.get("system_hash")
            bases.append(row)
        else:
            row.update(hits=s.get("hits") or 0, last_cache=s.get("last_cache"),
                       refused=bool(s.get("refused")))
            sessions.append(row)
    for rows in (sessions, bases):
        rows.sort(key=lambda r: r["last_used"] or "", reverse=True)
    return sessions, bases


def slots_view(listing: list[dict], llama_slots: list[dict]) -> list[dict]:
    """Every slot kvproxy drives and what it holds (``SlotSwitch.slot_listing``), with what
    llama-server says of it: busy while it processes, and its context size."""
    upstream = {s.get("id"): s for s in llama_slots if isinstance(s, dict)}
    rows = []
    for row in listing:
        seen = upstream.get(row["id"], {})
        rows.append({**row, "busy": row["busy"] or bool(seen.get("is_processing")),
                     "n_ctx": seen.get("n_ctx") or row.get("n_ctx")})
    return rows


def disk_view(root, bound_bytes: int, budget=None) -> dict:
    """Bytes of slot files against the bound, and the filesystem's free space; with the
    ``DiskBudget``: the free space it keeps, the saves it dropped and the disk's problem."""
    stored = folder_usage(root)
    usage = shutil.disk_usage(root)
    view = {"used_bytes": stored.stored_bytes, "files": stored.files,
            "logical_bytes": stored.logical_bytes, "chunks": stored.chunks,
            "stored_ratio": round(stored.ratio, 3) if stored.ratio else None,
            "bound_bytes": bound_bytes or None,
            "free_bytes": usage.free, "total_bytes": usage.total}
    saves = metrics.REGISTRY.get_sample_value("kvproxy_chunked_saves_total") or 0
    written = metrics.REGISTRY.get_sample_value("kvproxy_save_written_bytes_total") or 0
    logical = metrics.REGISTRY.get_sample_value("kvproxy_save_logical_bytes_total") or 0
    view.update(chunked_saves=int(saves),   # since start: what saves wrote against their files
                written_per_save=int(written / saves) if saves else None,
                logical_per_save=int(logical / saves) if saves else None)
    if budget is not None:
        view.update(kept_free_bytes=budget.floor(), saves_dropped=budget.dropped.count,
                    last_dropped=budget.dropped.last, problem=budget.problem())
    return view


def store_view(shared) -> dict | None:
    """The shared store (None: off): where, what waits, what was dropped, why it is not
    written now, and what this process uploaded and fetched (no credential: boto3 holds them)."""
    if shared is None:
        return None
    def count(name: str, **labels: str) -> int:
        return int(metrics.REGISTRY.get_sample_value(name, labels) or 0)
    return {"url": shared.url, "waiting": shared.uploader.waiting(),
            "dropped": shared.uploader.dropped, "problem": shared.problem(),
            "uploaded": count("kvproxy_store_uploads_total", outcome="written"),
            "uploaded_bytes": count("kvproxy_store_upload_bytes_total", kind="chunk") +
            count("kvproxy_store_upload_bytes_total", kind="session"),
            "fetched": count("kvproxy_store_fetches_total", outcome="fetched"),
            "fetch_failures": count("kvproxy_store_fetches_total", outcome="failed")}


def restore_check_view(entries: dict, limit: int, running_key: str | None,
                       now: datetime | None = None) -> dict:
    """Whether restoring is switched off for the running model, and how close it came.

    ``entries`` is the restore check's file (``RestoreCheck.entries()``). Same fields as
    the restore check in ``GET /api/sessions/current``.
    """
    now = now or datetime.now(timezone.utc)
    shown = {key: RestoreCheck._entry_status(entry, now) for key, entry in entries.items()
             if isinstance(entry, dict)}
    view = {"limit": limit, "models_off": sum(1 for st in shown.values() if st["restoring_off"]),
            "reset": routes.path_of("sessions.RestoreCheckReset")}
    if running_key is None:  # llama-server did not say which model runs
        view.update(restoring_off=None, misses_in_a_row=None, off_since=None, off_until=None,
                    cause=None)
    else:
        mine = shown.get(running_key) or RestoreCheck._entry_status({}, now)
        view.update(restoring_off=mine["restoring_off"], off_since=mine["off_since"],
                    off_until=mine["off_until"], misses_in_a_row=mine["misses_in_a_row"],
                    cause=mine["cause"])
    return view


# -- llama-server, asked briefly -----------------------------------------------
def probe_llama(view: ServerView, kv_format: str | None = None) -> dict:
    """Health, model and slots of llama-server (``ServerView.look``); never raises, every
    call bounded. ``kv_format``: what the start-up probe read, part of the running
    fingerprint."""
    look = view.look()
    llama: dict = {"url": view.client.base_url, "status": look.status, "error": look.error,
                   "model": None, "n_ctx": None, "build": None, "slots": [], "running_key": None}
    if look.props is not None and look.models is not None:
        made_by = fingerprint(look.props, look.models, kv_format, look.adapters or [])
        llama.update(model=(made_by["model_path"] or "").rsplit("/", 1)[-1] or None,
                     n_ctx=made_by["n_ctx"], build=made_by["build_info"],
                     running_key=fingerprint_key(made_by))
    llama["slots"] = look.slots or []
    return llama


def status_data(include_sessions: bool = True) -> dict:
    """Everything the page and ``python -m kvproxy`` show, for the app serving the request."""
    settings = current_app.config["KVPROXY"]
    switch = current_app.extensions["kvproxy.switch"]
    llama = probe_llama(current_app.extensions["kvproxy.models"].view, switch.kv_format)
    sessions, bases = session_rows(switch.store.sidecars()) if include_sessions else ([], [])
    running_key = llama.pop("running_key")
    llama_slots = llama.pop("slots")
    return {
        "version": __version__,
        "generated_at": now_iso(),
        "llama_server": llama,
        "slots": slots_view(current_app.extensions["kvproxy.models"].slot_listing(),
                            llama_slots),
        "stats": switch.activity.totals(),
        "timeline": switch.activity.timeline(),
        "swaps": switch.activity.recent_swaps(),
        "disk": disk_view(switch.store.root, switch.max_disk_bytes, switch.budget),
        "store": store_view(current_app.extensions.get("kvproxy.shared_store")),
        "restore_check": restore_check_view(switch.restore_check.entries(),
                                            settings.restore_miss_limit, running_key),
        "sessions": sessions if include_sessions else None,
        "bases": bases if include_sessions else None,
    }


class Status(MethodView):
    @api_blueprint.response(200)
    def get(self):
        """Slots, saved sessions, base snapshots, disk, shared store, cache outcomes, swaps,
        llama-server.

        ``?sessions=0`` leaves out the session and base lists (for quick polls).
        """
        return status_data(include_sessions=request.args.get("sessions", "1") != "0")


def page():
    """The status page: static HTML, CSS and JS that fetch ``/api/status``."""
    response = current_app.make_response(render_template(
        "status.html", token_required=bool(current_app.config["KVPROXY"].admin_token),
        version=__version__))
    response.headers["Content-Security-Policy"] = PAGE_CSP
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-store"
    return response


routes.add_rules(api_blueprint, globals())
routes.add_rules(page_blueprint, globals())


