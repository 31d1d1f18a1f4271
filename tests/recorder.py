"""Record what real clients send: a loopback HTTP relay that writes every request as a fixture.

The relay forwards each request to an upstream (llama-server or kvproxy) and streams the
answer back, so a client sees real replies and its next turn carries them. Every request
is kept as ``{"method", "path", "headers", "body"}``; ``scrub`` then removes what is
specific to the machine that recorded it (paths, user and host names, keys).

The fixtures under ``tests/fixtures/recorded/<client>/`` were made with
``python tests/record_clients.py``; the tests replay them.
"""
from __future__ import annotations

import getpass
import json
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests

# Headers that say nothing about the client's request, or that carry secrets.
DROPPED_HEADERS = {"host", "content-length", "connection", "accept-encoding", "keep-alive",
                   "transfer-encoding"}
SECRET_HEADERS = {"authorization": "Bearer dummy", "x-api-key": "dummy"}


def canned_reply(path: str, body: Any, text: str) -> tuple[str, bytes]:
    """An Anthropic answer with ``text`` (whole or as events): content type and bytes."""
    if "count_tokens" in path:
        return "application/json", json.dumps({"input_tokens": 100}).encode()
    model = body.get("model", "model") if isinstance(body, dict) else "model"
    usage = {"input_tokens": 100, "output_tokens": 8, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0}
    message = {"id": "msg_recorded", "type": "message", "role": "assistant", "model": model,
               "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
               "stop_sequence": None, "usage": usage}
    if not (isinstance(body, dict) and body.get("stream")):
        return "application/json", json.dumps(message).encode()
    start = {**message, "content": [], "stop_reason": None}
    events = [("message_start", {"type": "message_start", "message": start}),
              ("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": text}}),
              ("content_block_stop", {"type": "content_block_stop", "index": 0}),
              ("message_delta", {"type": "message_delta", "usage": usage,
                                 "delta": {"stop_reason": "end_turn", "stop_sequence": None}}),
              ("message_stop", {"type": "message_stop"})]
    return "text/event-stream", b"".join(
        f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


class Recorder:
    """A relay on 127.0.0.1 that keeps every request it forwards.

    Without an upstream it answers Anthropic requests itself with ``canned`` text:
    enough for a client's next turn to carry an answer, in bounded time.
    """

    def __init__(self, upstream: str | None, timeout: float = 300,
                 canned: str = "Hello! How can I help you today?"):
        self.upstream = upstream.rstrip("/") if upstream else None
        self.canned = canned
        self.timeout = timeout
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "Recorder":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _keep(self, method: str, path: str, headers: dict, raw: bytes) -> dict:
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        record = {"method": method, "path": path, "headers": headers, "body": body}
        with self._lock:
            self.requests.append(record)
        return record

    def _handler(self):
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: no framing to relay

            def log_message(self, *args):  # quiet
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()
                           if k.lower() not in DROPPED_HEADERS}
                record = recorder._keep(self.command, self.path, headers, raw)
                if recorder.upstream is None:
                    kind, data = canned_reply(self.path, record["body"], recorder.canned)
                    self.send_response(200)
                    self.send_header("Content-Type", kind)
                    self.end_headers()
                    self.wfile.write(data)
                    return
                try:
                    upstream = requests.request(
                        self.command, recorder.upstream + self.path, data=raw or None,
                        headers={k: v for k, v in headers.items()}, stream=True,
                        timeout=(5, recorder.timeout))
                except requests.RequestException as exc:
                    self.send_error(502, str(exc))
                    return
                with upstream:
                    self.send_response(upstream.status_code)
                    for name, value in upstream.headers.items():
                        if name.lower() not in DROPPED_HEADERS | {"content-encoding"}:
                            self.send_header(name, value)
                    self.end_headers()
                    for piece in upstream.raw.stream(4096, decode_content=True):
                        self.wfile.write(piece)
                        self.wfile.flush()

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _relay

        return Handler


def machine_strings(paths: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(text, replacement) pairs for what identifies the recording machine, longest first.

    ``paths`` maps folders of the recording run to neutral ones; their slug forms
    (Claude Code names its per-project folders ``-tmp-x-project``) are replaced too.
    """
    pairs = []
    for path, neutral in (paths or {}).items():
        pairs += [(path, neutral), (path.replace("/", "-"), neutral.replace("/", "-"))]
    # The home folder only as the start of a path: "/root" alone is also a word in what
    # clients send (Codex's agent_name "/root", a "</root>" tag).
    pairs.append((str(Path.home()).rstrip("/") + "/", "/home/user/"))
    # short names ("root", a host called "vm") would hit ordinary words and tags
    for name, neutral in ((socket.gethostname(), "host"), (getpass.getuser(), "user")):
        if len(name) > 4:
            pairs.append((name, neutral))
    return sorted(pairs, key=lambda pair: -len(pair[0]))


_KERNEL = re.compile(r"Linux \d+\.\d+\.\d+[^\s\"\\]*")
_DEVICE_ID = re.compile(r'("device_id\\?":\\?")[0-9a-fA-F]{16,}')


def scrub(value: Any, pairs: list[tuple[str, str]]) -> Any:
    """``value`` with every machine string replaced, recursively."""
    if isinstance(value, str):
        for text, replacement in pairs:
            value = value.replace(text, replacement)
        value = _DEVICE_ID.sub(lambda m: m.group(1) + "0" * 64, value)
        return _KERNEL.sub("Linux 6.0.0", value)
    if isinstance(value, list):
        return [scrub(v, pairs) for v in value]
    if isinstance(value, dict):
        return {k: scrub(v, pairs) for k, v in value.items()}
    return value


def write_fixtures(folder: Path, records: list[dict], names: list[str],
                   pairs: list[tuple[str, str]]) -> list[Path]:
    """One scrubbed JSON file per request, named ``NN-<name>.json`` in turn order."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    paths = []
    for number, (record, name) in enumerate(zip(records, names), start=1):
        record = scrub(record, pairs)
        record["headers"] = {k: SECRET_HEADERS.get(k, v) for k, v in record["headers"].items()}
        path = folder / f"{number:02d}-{name}.json"
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


def load_fixtures(folder: Path) -> list[dict]:
    """Every recorded request of one client, in turn order."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]


def env_without_proxies() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
