"""Every kvproxy setting, declared once with its default and help text.

Settings come from ``KVPROXY_*`` environment variables (or a dict in tests).
A bad value stops start-up with a one-line message naming the variable.
The configuration table of docs/configuration.md is generated from ``SETTINGS``
and a test keeps the two in step.
"""
from __future__ import annotations

import math
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping


from kvproxy.errors import ConfigError  # imported from here too


def _url(value: str) -> str:
    if not re.match(r"^https?://[^/\s]+", value):
        raise ValueError("expected an http:// or https:// URL")
    return value.rstrip("/")


def _number(low: float, high: float, *, whole: bool = False, above_low: bool = False
            ) -> Callable[[str], float | int]:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``above_low``)."""
    def parse(value: str) -> float | int:
        try:
            number = int(value) if whole else float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number > high or number < low or \
                (above_low and number == low):
            kind = "a whole number" if whole else "a number"
            lower = f"greater than {low:g}" if above_low else f"from {low:g}"
            raise ValueError(f"expected {kind} {lower} up to {high:g}")
        return number
    return parse


DAY = 86400.0
_timeout = _number(0, DAY, above_low=True)   # seconds; threading refuses huge bounds
_gigabytes = _number(0, 1e6)                  # up to a petabyte


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _regex(value: str) -> str:
    re.compile(value)
    return value


def _choice(*options: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in options:
            raise ValueError("expected one of " + ", ".join(options))
        return value
    return parse


def _dotted_version(value: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)*", value):
        raise ValueError("expected plain dotted integers such as 0.12.3")
    return value


def _node_name(value: str) -> str:
    """A reply header value: empty means this machine's host name."""
    value = value.strip() or socket.gethostname()
    if not re.fullmatch(r"[A-Za-z0-9._:-]{1,253}", value):
        raise ValueError("expected letters, digits and . _ : - only")
    return value


# A user name as listings, logs and file names may show it.
_USER_NAME = re.compile(r"[A-Za-z0-9_.@+-]{1,64}")
MIN_KEY_CHARS = 16


def _key_pair(key: str, user: str, where: str) -> tuple[str, str]:
    key, user = key.strip(), user.strip()
    if len(key) < MIN_KEY_CHARS or any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError(f"{where}: a key must be at least {MIN_KEY_CHARS} printable characters "
                         "without spaces")
    if not _USER_NAME.fullmatch(user):
        raise ValueError(f"{where}: a user name must be 1 to 64 letters, digits or . _ @ + -")
    return key, user


def _add_keys(pairs: list[tuple[str, str]]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for key, user in pairs:
        if key in keys:
            raise ValueError(f"the key of user {user!r} is also the key of user {keys[key]!r}")
        keys[key] = user
    return keys


def _api_keys(value: str) -> dict[str, str]:
    """``key=user`` pairs, comma-separated: the users' keys (never shown, never logged)."""
    pairs = []
    for n, part in enumerate((p for p in value.split(",") if p.strip()), 1):
        key, sep, user = part.rpartition("=")
        if not sep:
            raise ValueError(f"pair {n}: expected key=user")
        pairs.append(_key_pair(key, user, f"pair {n}"))
    return _add_keys(pairs)


def _api_keys_file(value: str) -> dict[str, str]:
    """A file of ``user key`` lines (``#`` comments, blank lines); only its owner may read it."""
    if not value.strip():
        return {}
    try:
        mode = os.stat(value).st_mode
        if mode & 0o077:
            raise ValueError(f"{value} can be read or written by others (mode "
                             f"{mode & 0o777:o}): chmod 600 it")
        with open(value, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError as exc:
        raise ValueError(f"{value}: {exc.strerror or exc}") from None
    pairs = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"line {n}: expected 'user key'")
        pairs.append(_key_pair(parts[1], parts[0], f"line {n}"))
    return _add_keys(pairs)


def _store_url(value: str) -> str:
    """``s3://<bucket>/<prefix>`` (the prefix optional), or empty: no shared store. Endpoint
    and credentials are boto3's to find, never part of the URL."""
    value = value.strip()
    if not value:
        return ""
    from kvproxy.storage.shared.location import StoreLocation
    return StoreLocation.parse(value).url


def _log_level(value: str) -> str:
    return _choice("DEBUG", "INFO", "WARNING", "ERROR")(value.upper())


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    parse: Callable[[str], Any]
    help: str

    @property
    def env(self) -> str:
        return "KVPROXY_" + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("upstream", "http://127.0.0.1:8080", _url,
            "Base URL of llama-server."),
    Setting("slot_dir", "/var/cache/llama-slots", str,
            "Folder of slot files: the same folder as llama-server's --slot-save-path."),
    Setting("slots", "0", _number(0, 4096, whole=True),
            "How many llama-server slots kvproxy drives (ids 0 to N-1), each holding one "
            "conversation; 0: as many as llama-server reports (-np). Its -c is split between them."),
    Setting("slot_id", "0", _number(0, 4095, whole=True),
            "With one slot: the llama-server slot kvproxy drives."),
    Setting("admin_token", "", str,
            "When set, the admin API (/api/sessions, /api/status) needs 'Authorization: Bearer <token>'."),
    Setting("api_keys", "", _api_keys,
            "Client API keys as key=user pairs, comma-separated (keys of 16 characters or more, "
            "user names of letters, digits and . _ @ + -). When any key is set (here or in "
            "KVPROXY_API_KEYS_FILE), every client route needs one, as llama-server's --api-key: "
            "'Authorization: Bearer <key>' or 'x-api-key: <key>', else 401 in the API's own "
            "error format; each user's sessions, files, base snapshots and listings are their "
            "own. Needs KVPROXY_ADMIN_TOKEN. See docs/clients.md, 'Users and keys'."),
    Setting("api_keys_file", "", _api_keys_file,
            "A file of client API keys, one 'user key' line each ('#' comments); it must not be "
            "readable by others (chmod 600). Read at start; adds to KVPROXY_API_KEYS."),
    Setting("upstream_api_key", "", str,
            "The key llama-server was started with (--api-key): sent as 'Authorization: "
            "Bearer' on every call kvproxy makes to it, relayed ones included."),
    Setting("allowed_hosts", "host.docker.internal", _csv,
            "Host names kvproxy answers to besides loopback names (localhost), IP addresses and "
            "this machine's host name, comma-separated ('.example.com': it and every name under "
            "it; '*': any). A request for any other Host is refused with 403, so a web page "
            "whose name points at kvproxy (DNS rebinding) cannot use it. Behind a proxy that "
            "passes Host, list the names clients use."),
    Setting("allowed_origins", "", _csv,
            "Web pages (origins such as https://chat.example.com) whose browser requests may "
            "change something (chats, admin actions) or read the admin API; a request from a page "
            "on any other site is refused with 403. Clients that are not browsers are not "
            "affected."),
    Setting("node_name", "", _node_name,
            "Name of this machine, sent in the X-KVProxy-Node header of every reply (several "
            "machines behind one balancer); empty: the host name."),
    Setting("lock_timeout", "300", _timeout,
            "Seconds a request may wait for the slot before it gets 503 with Retry-After."),
    Setting("max_waiters", "16", _number(0, 100000, whole=True),
            "Requests that may wait for the slot at once; past it a request gets 503 with "
            "Retry-After at once. Keep it below the server's threads (KVPROXY_THREADS) so "
            "/health, /metrics and the admin API always find a free thread."),
    Setting("connect_timeout", "5", _timeout,
            "Seconds to wait for a connection to llama-server."),
    Setting("read_timeout", "600", _timeout,
            "Seconds llama-server may stay silent during one request (prefill of a long prompt included)."),
    Setting("slot_action_timeout", "300", _timeout,
            "Seconds a save, restore or erase may take."),
    Setting("receive_timeout", "30", _timeout,
            "Seconds a client may take to send a request's headers and body, plus one second per "
            "16 KiB received (slow links, large bodies); a request that has not arrived by then "
            "is closed. The worker's main loop reads requests, so slow clients never hold a "
            "thread meanwhile."),
    Setting("session_headers",
            "X-Session-Id,X-Conversation-Id,Session-Id,Conversation-Id,"
            "X-OpenWebUI-Chat-Id,X-Claude-Code-Session-Id,X-Session-Affinity,X-LiteLLM-Session-Id", _csv,
            "Request headers that name a session, in priority order."),
    Setting("anonymous_sessions", "conversation", _choice("conversation", "system"),
            "How a request without any id is grouped: 'conversation' (system prompt plus first user "
            "message: each conversation keeps its own cache) or 'system' (system prompt only: the "
            "original design's shared sys-<hash> slot)."),
    Setting("match_min_tokens", "512", _number(0, 1e9, whole=True),
            "A request without any id continues (or forks from) the saved conversation of its "
            "client it shares the longest start with, when that start is at least this many "
            "tokens (counted as 4 characters each, without a tokenizer); 0: keyed by its "
            "first messages alone."),
    Setting("base_snapshots", "true", _bool,
            "Start a new session from a saved snapshot of a system prompt seen before."),
    Setting("save_behind", "true", _bool,
            "Save a conversation's new turns in the background once its slot has been idle "
            "KVPROXY_SAVE_BEHIND_DELAY seconds: a crash then loses nothing, and a swap pays "
            "only the restore."),
    Setting("save_behind_delay", "2", _number(0, 3600),
            "Seconds a slot stays idle after an answer before its new turns are saved in the "
            "background (a tool call that comes straight back pays nothing)."),
    Setting("slot_keep", "2", _number(0, 3600),
            "Seconds a slot stays kept for the conversation that just used it while new "
            "conversations wait, so a reply answered at once (a user, a tool call) is not put "
            "behind another conversation's whole prefill; with several slots one is never kept, "
            "and a new conversation is passed over this way at most 16 times. 0: off."),
    Setting("side_request_pattern", r"^### Task:", _regex,
            "Regular expression: a non-streaming request whose only user message matches it is a side "
            "request (OpenWebUI titles, tags, follow-ups) and never overwrites a conversation's file."),
    Setting("restore_miss_limit", "2", _number(0, 1000, whole=True),
            "Restores in a row that llama-server does not honour before restoring is switched off for "
            "that model (0: never switch off)."),
    Setting("restore_off_minutes", "60", _number(0, 525600, above_low=True),
            "Minutes restoring stays switched off after that; POST /api/sessions/restore-check/reset "
            "turns it back on at once."),
    Setting("session_store", "chunks", _choice("chunks", "files"),
            "How saved conversations are kept in the slot folder: 'chunks' (each token range "
            "stored once, shared by every conversation and base snapshot that starts with it; a "
            "save writes only what is new) or 'files' (one whole slot file per conversation, as "
            "llama-server writes it: for comparison, or as a fallback)."),
    Setting("chunk_tokens", "256", _number(16, 65536, whole=True),
            "Tokens per stored chunk with KVPROXY_SESSION_STORE=chunks (the field's default; "
            "docs/benchmark.md has the measurement). Chunks of another size are not shared."),
    Setting("hot_dir", "", str,
            "A folder in memory (tmpfs: /dev/shm, or /run with systemd's RuntimeDirectory) for "
            "whole files of recently saved and restored conversations stored as chunks: "
            "llama-server saves into it, and restores from it as fast as from a whole file "
            "instead of waiting for the file to be put together from chunks. It must be "
            "writable by llama-server's user and hold nothing else; it is a cache, nothing is "
            "lost without it. Empty: off (docs/sessions-and-slots.md, 'Hot copies')."),
    Setting("hot_gb", "2", _gigabytes,
            "Upper bound on the memory the hot copies of KVPROXY_HOT_DIR take (GiB); the least "
            "recently used go first."),
    Setting("store_url", "", _store_url,
            "The shared session store: s3://<bucket>/<prefix> of an S3 bucket (SeaweedFS, MinIO, "
            "Ceph RGW, AWS S3) that every node's saved conversations are copied to in the "
            "background, each user's under a prefix of their own; empty: off. The endpoint and "
            "credentials come from boto3's own settings (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance roles), never from this URL. See "
            "docs/shared-store.md."),
    Setting("store_timeout", "10", _timeout,
            "Seconds to connect to the shared store, and seconds it may stay silent during one "
            "call; each call is tried at most 3 times."),
    Setting("store_queue", "256", _number(1, 1e6, whole=True),
            "Conversations whose newest save waits for its upload to the shared store (one entry "
            "per conversation: a newer save replaces the waiting one). Past it the oldest "
            "waiting upload is dropped and counted (kvproxy_store_uploads_dropped_total); the "
            "local copy is kept."),
    Setting("store_fetch_seconds", "30", _timeout,
            "Longest a conversation missing from the slot folder may take to come from the "
            "shared store (its session, then its chunks, several at once); a fetch is also not "
            "made when it would take longer than computing the prompt, by this node's recent "
            "figures, nor allowed to take longer than that (see the shared store's page). Past "
            "it, or when the fetch fails, its prompt is computed, with one log line."),
    Setting("store_sweep_minutes", "60", _number(0, 525600),
            "Minutes between this node's tries to sweep the shared store of chunks no session "
            "object names (one node at a time, under a lease in the bucket); 0: never (POST "
            "/api/store/sweep and 'kvproxy sweep' still run one)."),
    Setting("store_sweep_grace_seconds", "3600", _number(60, 1e7),
            "Age a chunk of the shared store must reach before a sweep may delete it when no "
            "session object names it: longer than any upload takes (an upload writes its "
            "chunks before the session object that names them)."),
    Setting("store_max_gb", "0", _gigabytes,
            "Size budget of the shared store (GiB of chunks and session objects, every user's), "
            "kept by its sweeps: over it, the least recently saved conversations are evicted "
            "from the store, their session objects and the chunks no other conversation names; "
            "nodes keep their local copies. 0: no budget."),
    Setting("max_disk_gb", "100", _gigabytes,
            "Upper bound on the slot folder's size; before a save the least recently used slot files "
            "are deleted to keep it (0: no bound)."),
    Setting("min_free_gb", "1", _gigabytes,
            "Free space kept on the slot folder's filesystem, at most a tenth of its size: before a "
            "save, least recently used slot files are deleted to keep it; when even that cannot, the "
            "save is dropped (the session's newest turns are not kept on disk, its older file stays) "
            "and the swap goes ahead (0: only drop a save that does not fit at all)."),
    Setting("max_body_mb", "64", _number(0, 1e6, above_low=True),
            "Largest request body in MiB (long prompts and base64 images fit); a larger one is "
            "answered 413 in the client's API format before it is read."),
    Setting("max_messages", "4096", _number(1, 1e9, whole=True),
            "Most messages one chat request may hold; a longer one is refused with 400 in the "
            "client's API format before it waits for the slot (llama-server would spend minutes "
            "rendering the template of tens of thousands of messages while holding the slot)."),
    Setting("max_chars_per_token", "32", _number(1, 1e6, above_low=True),
            "Generous bound on characters per token: a request whose text has more than the "
            "slot's context (n_ctx) times this many characters cannot fit and is refused with "
            "400 in the client's API format before it waits for the slot, as llama-server "
            "would refuse it after tokenizing."),
    Setting("model_name", "", str,
            "Name under which the model is listed; empty: the GGUF file name of llama-server's model."),
    Setting("model_tag", "latest", str,
            "Tag appended to the model name on the Ollama routes."),
    Setting("ollama_version", "0.12.3", _dotted_version,
            "Version reported by GET /api/version (plain dotted integers)."),
    Setting("log_level", "INFO", _log_level,
            "Log level: DEBUG, INFO, WARNING or ERROR."),
)


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Empty means None (a default worked out from other settings)."""
    return lambda value: parse(value) if value.strip() else None


# The server process's settings: gunicorn's (kvproxy/gunicorn_conf.py), which ``kvproxy serve``
# also takes as options. The "Process settings" table of docs/configuration.md comes from here.
PROCESS_SETTINGS: tuple[Setting, ...] = (
    Setting("host", "127.0.0.1", str,
            "Address kvproxy listens on (0.0.0.0: every interface)."),
    Setting("port", "11434", _number(1, 65535, whole=True),
            "Port kvproxy listens on."),
    Setting("threads", "", _optional(_number(1, 100000, whole=True)),
            "Server threads; empty: KVPROXY_MAX_WAITERS + 16, so threads stay free for /health, "
            "/metrics and the admin API while the most requests allowed wait for the slot."),
    Setting("worker_timeout", "120", _number(1, DAY, whole=True),
            "Seconds of silence after which gunicorn restarts a hung worker; it never cuts a "
            "long stream (the heartbeat comes from the worker's main thread)."),
    Setting("graceful_timeout", "120", _number(1, DAY, whole=True),
            "Seconds a stop (SIGTERM) lets running answers finish before the session each slot "
            "holds is saved."),
    Setting("stop_grace", "", _optional(_number(0, DAY)),
            "Seconds a stream may still run after SIGTERM, then it ends with an error event in "
            "its API's format; empty: KVPROXY_GRACEFUL_TIMEOUT less 20."),
    Setting("keepalive", "75", _number(1, DAY, whole=True),
            "Seconds an idle client connection stays open; longer than nginx keeps idle "
            "upstream connections (keepalive_timeout 60s)."),
    Setting("forwarded_allow_ips", "127.0.0.1,::1", str,
            "Proxies whose X-Forwarded-Proto and X-Forwarded-For are believed, comma-separated "
            "(behind them, the forwarded client address scopes conversations sent without an "
            "id)."),
)

SECRETS = ("admin_token", "api_keys", "api_keys_file", "upstream_api_key")
# Settings whose refused value is not repeated in the error: the keys, and a store URL that
# may carry the credentials someone put there by mistake.
NOT_ECHOED = tuple(s for s in SECRETS if s != "api_keys_file") + ("store_url",)

# Process settings the app reads too, through its Settings like every other: behind a
# proxy gunicorn trusts, the client's address is the one that proxy forwards
# (kvproxy.web.users).
SHARED_WITH_THE_APP = tuple(s for s in PROCESS_SETTINGS if s.name == "forwarded_allow_ips")


class Settings:
    """Parsed settings, read as attributes (``settings.slot_dir``)."""

    def __init__(self, values: Mapping[str, Any]):
        self.__dict__.update(values)

    def __repr__(self) -> str:
        shown = {k: ("***" if k in SECRETS and v else v) for k, v in self.__dict__.items()}
        return f"Settings({shown})"


def load_settings(environ: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Read every setting from ``environ`` (default: the process environment).

    ``overrides`` take setting names (``slot_dir``) and are used as given,
    which is how tests build an app without touching the environment.
    """
    return _load(SETTINGS + SHARED_WITH_THE_APP, environ, overrides)


def load_process_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the server process's settings (``PROCESS_SETTINGS``) as ``load_settings`` does,
    with the defaults worked out from other settings filled in."""
    process = _load(PROCESS_SETTINGS, environ, None)
    if process.threads is None:
        waiters = _load(tuple(s for s in SETTINGS if s.name == "max_waiters"), environ, None)
        process.threads = waiters.max_waiters + 16
    if process.stop_grace is None:
        process.stop_grace = float(max(0, process.graceful_timeout - 20))
    return process


def _load(table: tuple[Setting, ...], environ: Mapping[str, str] | None,
          overrides: Mapping[str, Any] | None) -> Settings:
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    values: dict[str, Any] = {}
    for setting in table:
        if setting.name in overrides:
            values[setting.name] = overrides.pop(setting.name)
            continue
        raw = environ.get(setting.env, setting.default)
        try:
            values[setting.name] = setting.parse(raw)
        except (ValueError, re.error) as exc:
            shown = "(hidden)" if setting.name in NOT_ECHOED else repr(raw)  # nor a key a log
            raise ConfigError(f"{setting.env}={shown} is invalid: {exc}") from None
    if overrides:
        raise ConfigError("unknown settings: " + ", ".join(sorted(overrides)))
    _merge_keys(values)
    return Settings(values)


def _merge_keys(values: dict[str, Any]) -> None:
    """Both sources of client keys as one table (``api_keys``); keys need the admin token,
    else anyone could list and delete every user's sessions through the admin API."""
    keys = dict(values.get("api_keys") or {})
    for key, user in (values.get("api_keys_file") or {}).items():
        if key in keys and keys[key] != user:
            raise ConfigError(f"KVPROXY_API_KEYS_FILE gives user {user!r} the key of user "
                              f"{keys[key]!r} in KVPROXY_API_KEYS")
        keys[key] = user
    values["api_keys"] = keys
    if keys and not values.get("admin_token"):
        raise ConfigError("KVPROXY_API_KEYS needs KVPROXY_ADMIN_TOKEN: without it anyone could "
                          "list and delete every user's sessions through the admin API")


def check_slot_dir(path: str) -> None:
    """The slot folder exists (created if needed) and kvproxy can write in it, else ConfigError.

    Writes a file rather than asking ``os.access``, which says yes to root on a
    read-only filesystem.
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".kvproxy-write-check."):
            pass
    except OSError as exc:
        raise ConfigError(f"KVPROXY_SLOT_DIR={path!r} cannot be used: {exc.strerror or exc} "
                          "(create it, or point KVPROXY_SLOT_DIR at a folder kvproxy can write)"
                          ) from None


def markdown_table(table: tuple[Setting, ...] = SETTINGS) -> str:
    """A configuration table of docs/configuration.md (kvproxy's settings, or the process's)."""
    rows = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    for setting in table:
        default = f"`{setting.default}`" if setting.default else "(empty)"
        rows.append(f"| `{setting.env}` | {default} | {setting.help} |")
    return "\n".join(rows)
