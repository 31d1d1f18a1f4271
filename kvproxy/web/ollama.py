"""Ollama API: the routes OpenWebUI, the ``ollama`` client and Copilot call.

kvproxy serves the one model llama-server loaded, under ``<name>:<model_tag>``.
Chat and generate are translated by ``ollama_translate`` and run through the
relay like every dialect; model routes describe the model from llama-server's
``/props`` and ``/v1/models`` plus the GGUF header when the file is readable.
"""
from __future__ import annotations

import json
import time
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from kvproxy.upstream.llama import UpstreamError
from kvproxy.errors import ClientError, KvproxyError
from kvproxy.relay.context import ChatCall
from kvproxy.translate import ollama as tr
from kvproxy import routes
from kvproxy.web.common import json_body, relay, serve_chat
from kvproxy.upstream.gguf import model_file
from kvproxy.translate.ollama_model import describe_facts

blueprint = Blueprint("ollama", __name__)

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
def describe(requested: object = None) -> dict:
    """The served model (behind a router: the one ``requested`` names) in the terms every
    Ollama model route uses."""
    return _described(relay().model_facts(requested))


def describe_all() -> list[dict]:
    """Every model llama-server serves, described."""
    return [_described(facts) for facts in relay().all_model_facts()]


def _described(facts: dict) -> dict:
    return describe_facts(facts, current_app.config["KVPROXY"].model_tag, model_file(facts))


def root() -> Response:
    return Response("Ollama is running", mimetype="text/plain")


def version() -> Response:
    return jsonify({"version": current_app.config["KVPROXY"].ollama_version})


def _listed(model: dict) -> dict:
    return {key: model[key] for key in ("name", "size", "digest", "details")} | {
        "model": model["name"], "modified_at": model["modified_at"]}


def tags() -> Response:
    return jsonify({"models": [_listed(model) for model in describe_all()]})


def show() -> Response:
    body = json_body()
    model = describe(body.get("model") or body.get("name"))
    requested_model(body, model)
    return jsonify({
        "license": model["license"], "template": model["template"],
        "modelfile": f"# served by llama-server through kvproxy\nFROM {model['path']}\n",
        "parameters": f"num_ctx {model['context_length']}", "details": model["details"],
        "model_info": model["model_info"], "capabilities": model["capabilities"],
        "modified_at": model["modified_at"]})


def ps() -> Response:
    """The model is loaded while llama-server runs; VRAM use is not reported by llama-server."""
    return jsonify({"models": [
        _listed(model) | {"expires_at": NEVER_EXPIRES, "size_vram": 0,
                          "context_length": model["context_length"]}
        for model in describe_all() if model["loaded"] and not model["sleeping"]]})


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
                      render_stream_error=render_stream_error, mimetype=NDJSON)


def generation(kind: str) -> Response:
    """/api/chat and /api/generate. An empty request only "loads" the model: slot untouched."""
    started = time.monotonic_ns()
    body = json_body()
    model = describe(body.get("model"))
    name, stream = requested_model(body, model), _stream_flag(body)
    empty = not body.get("messages") if kind == "chat" else \
        not (body.get("prompt") or body.get("images"))
    if empty:
        return jsonify(tr.load_reply(kind, name, body.get("keep_alive")))
    vision = "vision" in model["capabilities"]
    path, upstream = ("/v1/chat/completions", tr.chat_body(body, vision)) if kind == "chat" \
        else tr.generate_call(body, vision)
    call = ChatCall(body=upstream, headers=request.headers, raw=body, path=path,
                    model=model["upstream_id"], translated=True)
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


def embed(field: str) -> Response:
    """/api/embed (one or many inputs) and the older /api/embeddings (one prompt)."""
    started = time.monotonic_ns()
    body = json_body()
    model = describe(body.get("model"))
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


def manage(action: str, field: str | None, digest: str = "") -> Response:
    """A clear 4xx: 404 for an unknown model, 400 for anything done to the served one.

    There is no blob store, so HEAD /api/blobs says the blob is absent.
    """
    if request.method == "HEAD":
        return Response(status=404)
    model = describe()
    if digest:  # an upload (``ollama create``): refused without reading a byte of it
        raise ClientError(ONE_MODEL.format(name=model["name"], action=action),
                          headers={"Connection": "close"})
    try:
        body = json_body()
    except ClientError:
        body = None
    if field and isinstance(body, dict) and (body.get(field) or body.get("name")):
        requested_model(body, model, field)
    raise ClientError(ONE_MODEL.format(name=model["name"], action=action))


routes.add_rules(blueprint, globals())
