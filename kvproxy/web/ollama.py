"""Ollama API: the routes OpenWebUI, the ``ollama`` client and Copilot call.

kvproxy serves the one model llama-server loaded, under ``<name>:<model_tag>``.
Chat and generate are translated by ``ollama_translate`` and run through the
relay like every dialect; model routes describe the model from llama-server's
``/props`` and ``/v1/models`` plus the GGUF header when the file is readable.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any, Callable

from flask import Blueprint, Response, current_app, jsonify, request
from werkzeug.exceptions import HTTPException

from kvproxy.upstream.llama import UpstreamError
from kvproxy.errors import ClientError, KvproxyError
from kvproxy.web.relay import ChatCall
from kvproxy.translate import ollama as tr
from kvproxy.web.common import HANDLED, failure, json_body, relay, serve_chat
from kvproxy.translate.ollama_model import describe

blueprint = Blueprint("ollama", __name__)
log = logging.getLogger("kvproxy.ollama")

NDJSON = "application/x-ndjson"
# llama-server keeps its model loaded for as long as it runs.
NEVER_EXPIRES = "9999-12-31T23:59:59Z"
NO_EMBEDDINGS = ("embeddings are not available: llama-server answers that it does not support "
                 "them; start llama-server with --embeddings to use /api/embed")
ONE_MODEL = ("kvproxy serves the one model llama-server loaded ('{name}') and cannot {action} "
             "models; load another GGUF in llama-server instead")


# -- wire helpers -----------------------------------------------------------
def ndjson(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def render_error(status: int, message: str, headers: dict | None = None) -> Response:
    response = jsonify({"error": message})
    response.status_code = status
    response.headers.update(headers or {})
    return response


def render_stream_error(_status: int, message: str) -> bytes:
    return ndjson({"error": message})


def answers_errors(view: Callable) -> Callable:
    """Every failure as Ollama's ``{"error": ...}`` with its status, never an HTML page."""
    @functools.wraps(view)
    def wrapped(*args, **kwargs):
        try:
            return view(*args, **kwargs)
        except ClientError as exc:
            return render_error(exc.status, exc.message)
        except HANDLED as exc:
            return render_error(*failure(exc))
        except HTTPException:  # e.g. 413: the app's handler answers it in this format
            raise
        except Exception as exc:  # noqa: BLE001 - a client must still get JSON
            log.exception("ollama route %s failed", request.path)
            return render_error(500, f"kvproxy internal error: {exc.__class__.__name__}")
    return wrapped


def requested_model(body: dict, model: dict, field: str = "model") -> str:
    """The name the client asked for; it must be the served model, with or without its tag."""
    name = body.get(field) or (body.get("name") if field == "model" else None)
    if not isinstance(name, str) or not name.strip():
        raise ClientError(f"'{field}' is required")
    accepted = {model["name"].lower(), model["base"].lower(), model["upstream_id"].lower()}
    if name.strip().lower() not in accepted:
        raise ClientError(f"model '{name}' not found", 404)
    return name


def _stream_flag(body: dict) -> bool:
    """Ollama streams unless told ``stream: false``."""
    stream = body.get("stream")
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise ClientError("'stream' must be true or false")
    return stream


# -- model routes -----------------------------------------------------------
@blueprint.route("/", methods=["GET", "HEAD"])
def root() -> Response:
    return Response("Ollama is running", mimetype="text/plain")


@blueprint.get("/api/version")
def version() -> Response:
    return jsonify({"version": current_app.config["KVPROXY"].ollama_version})


def _listed(model: dict) -> dict:
    return {key: model[key] for key in ("name", "size", "digest", "details")} | {
        "model": model["name"], "modified_at": model["modified_at"]}


@blueprint.get("/api/tags")
@answers_errors
def tags() -> Response:
    return jsonify({"models": [_listed(describe())]})


@blueprint.post("/api/show")
@answers_errors
def show() -> Response:
    model = describe()
    requested_model(json_body(), model)
    return jsonify({
        "license": model["license"], "template": model["template"],
        "modelfile": f"# served by llama-server through kvproxy\nFROM {model['path']}\n",
        "parameters": f"num_ctx {model['context_length']}", "details": model["details"],
        "model_info": model["model_info"], "capabilities": model["capabilities"],
        "modified_at": model["modified_at"]})


@blueprint.get("/api/ps")
@answers_errors
def ps() -> Response:
    """The model is loaded while llama-server runs; VRAM use is not reported by llama-server."""
    model = describe()
    if model["sleeping"]:
        return jsonify({"models": []})
    entry = _listed(model) | {"expires_at": NEVER_EXPIRES, "size_vram": 0,
                              "context_length": model["context_length"]}
    return jsonify({"models": [entry]})


# -- generation -------------------------------------------------------------
def _serve(call: ChatCall, kind: str, name: str, stream: bool, started: int,
           keep_thinking: bool) -> Response:
    def render_full(result: dict) -> dict:
        return tr.full_reply(kind, result, name, started, time.monotonic_ns(), keep_thinking)

    def render_stream(events):
        for obj in tr.stream_objects(events, kind=kind, model=name, started_ns=started,
                                     clock=time.monotonic_ns, keep_thinking=keep_thinking):
            yield ndjson(obj)

    return serve_chat(call, stream=stream, render_full=render_full, render_stream=render_stream,
                      render_error=render_error, render_stream_error=render_stream_error,
                      mimetype=NDJSON)


@blueprint.post("/api/chat", defaults={"kind": "chat"})
@blueprint.post("/api/generate", defaults={"kind": "generate"})
@answers_errors
def generation(kind: str) -> Response:
    """/api/chat and /api/generate. An empty request only "loads" the model: slot untouched."""
    started = time.monotonic_ns()
    body = json_body()
    model = describe()
    name, stream = requested_model(body, model), _stream_flag(body)
    empty = not body.get("messages") if kind == "chat" else \
        not (body.get("prompt") or body.get("images"))
    if empty:
        return jsonify(tr.load_reply(kind, name, body.get("keep_alive")))
    vision = "vision" in model["capabilities"]
    path, upstream = ("/v1/chat/completions", tr.chat_body(body, vision)) if kind == "chat" \
        else tr.generate_call(body, vision)
    call = ChatCall(body=upstream, headers=request.headers, raw=body, path=path)
    return _serve(call, kind, name, stream, started, body.get("think") is not False)


def _embed(inputs: list[str], model: dict) -> tuple[list[list[float]], int]:
    """Vectors from llama-server's /v1/embeddings, in input order, and the tokens used."""
    try:
        result = relay().side_call("/v1/embeddings", {"input": inputs,
                                                      "model": model["upstream_id"]})
    except UpstreamError as exc:
        if exc.status == 501 or "--embeddings" in exc.message:
            raise KvproxyError(NO_EMBEDDINGS, 501) from None
        raise
    data = sorted(result.get("data") or [], key=lambda item: item.get("index", 0))
    return [item.get("embedding") or [] for item in data], \
        int((result.get("usage") or {}).get("prompt_tokens") or 0)


def _shorten(vector: list[float], dimensions: Any) -> list[float]:
    """Ollama's ``dimensions``: keep the first N values and scale back to unit length."""
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions <= 0:
        return vector
    cut = vector[:dimensions]
    norm = sum(v * v for v in cut) ** 0.5
    return [v / norm for v in cut] if norm else cut


@blueprint.post("/api/embed", defaults={"field": "input"})
@blueprint.post("/api/embeddings", defaults={"field": "prompt"})
@answers_errors
def embed(field: str) -> Response:
    """/api/embed (one or many inputs) and the older /api/embeddings (one prompt)."""
    started = time.monotonic_ns()
    body = json_body()
    model = describe()
    name = requested_model(body, model)
    inputs = body.get(field) or []
    inputs = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        raise ClientError(f"'{field}' must be a string or a list of strings")
    vectors, tokens = _embed(inputs, model) if inputs else ([], 0)
    if field == "prompt":
        return jsonify({"embedding": vectors[0] if vectors else []})
    return jsonify({"model": name,
                    "embeddings": [_shorten(v, body.get("dimensions")) for v in vectors],
                    "total_duration": time.monotonic_ns() - started, "load_duration": 0,
                    "prompt_eval_count": tokens})


# -- model management: one model, served by llama-server ----------------------
@blueprint.post("/api/pull")
@answers_errors
def pull() -> Response:
    """Pulling the served model succeeds at once: it is already there."""
    body = json_body()
    model = describe()
    try:
        requested_model(body, model)
    except ClientError as exc:
        if exc.status != 404:
            raise
        raise ClientError(f"{exc.message}: " + ONE_MODEL.format(
            name=model["name"], action="pull other"), 404) from None
    if not _stream_flag(body):
        return jsonify({"status": "success"})
    return Response(ndjson({"status": "success"}), mimetype=NDJSON)


@blueprint.post("/api/create", defaults={"action": "create", "field": None})
@blueprint.post("/api/push", defaults={"action": "push", "field": "model"})
@blueprint.post("/api/copy", defaults={"action": "copy", "field": "source"})
@blueprint.delete("/api/delete", defaults={"action": "delete", "field": "model"})
@blueprint.route("/api/blobs/<path:digest>", methods=["HEAD", "POST"],
                 defaults={"action": "upload blobs for", "field": None})
@answers_errors
def manage(action: str, field: str | None, digest: str = "") -> Response:
    """A clear 4xx: 404 for an unknown model, 400 for anything done to the served one.

    There is no blob store, so HEAD /api/blobs says the blob is absent.
    """
    if request.method == "HEAD":
        return Response(status=404)
    model = describe()
    if digest:  # an upload (``ollama create``): refused without reading a byte of it
        return render_error(400, ONE_MODEL.format(name=model["name"], action=action),
                            {"Connection": "close"})
    try:
        body = json_body()
    except ClientError:
        body = None
    if field and isinstance(body, dict) and (body.get(field) or body.get("name")):
        requested_model(body, model, field)
    raise ClientError(ONE_MODEL.format(name=model["name"], action=action))
