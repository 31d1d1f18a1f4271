"""Every kvproxy setting, declared once with its default and help text.

Settings come from ``KVPROXY_*`` environment variables (or a dict in tests).
A bad value stops start-up with a one-line message naming the variable.
The README's configuration table is generated from ``SETTINGS`` and a test
keeps the two in step.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping


class ConfigError(ValueError):
    """A setting has a value kvproxy cannot use."""


def _url(value: str) -> str:
    if not re.match(r"^https?://[^/\s]+", value):
        raise ValueError("expected an http:// or https:// URL")
    return value.rstrip("/")


def _positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise ValueError("expected a number greater than 0")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError("expected a whole number of 0 or more")
    return number


def _non_negative_float(value: str) -> float:
    number = float(value)
    if number < 0:
        raise ValueError("expected a number of 0 or more")
    return number


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
    Setting("slot_id", "0", _non_negative_int,
            "The llama-server slot kvproxy manages (run llama-server with -np 1)."),
    Setting("admin_token", "", str,
            "When set, the /api/sessions endpoints need 'Authorization: Bearer <token>'."),
    Setting("node_name", "", _node_name,
            "Name of this machine, sent in the X-KVProxy-Node header of every reply (several "
            "machines behind one balancer); empty: the host name."),
    Setting("lock_timeout", "300", _positive_float,
            "Seconds a request may wait for the slot before it gets 503 with Retry-After."),
    Setting("connect_timeout", "5", _positive_float,
            "Seconds to wait for a connection to llama-server."),
    Setting("read_timeout", "600", _positive_float,
            "Seconds llama-server may stay silent during one request (prefill of a long prompt included)."),
    Setting("slot_action_timeout", "300", _positive_float,
            "Seconds a save, restore or erase may take."),
    Setting("session_headers",
            "X-Session-Id,X-Conversation-Id,Session-Id,Conversation-Id,"
            "X-OpenWebUI-Chat-Id,X-Claude-Code-Session-Id", _csv,
            "Request headers that name a session, in priority order."),
    Setting("anonymous_sessions", "conversation", _choice("conversation", "system"),
            "How a request without any id is grouped: 'conversation' (system prompt plus first user "
            "message: each conversation keeps its own cache) or 'system' (system prompt only: the "
            "original design's shared sys-<hash> slot)."),
    Setting("base_snapshots", "true", _bool,
            "Start a new session from a saved snapshot of a system prompt seen before."),
    Setting("side_request_pattern", r"^### Task:", _regex,
            "Regular expression: a non-streaming request whose only user message matches it is a side "
            "request (OpenWebUI titles, tags, follow-ups) and never overwrites a conversation's file."),
    Setting("restore_miss_limit", "2", _non_negative_int,
            "Restores in a row that llama-server does not honour before restoring is switched off for "
            "that model (0: never switch off)."),
    Setting("max_disk_gb", "100", _non_negative_float,
            "Upper bound on the slot folder's size; past it the least recently used slot files "
            "are deleted (0: no bound)."),
    Setting("model_name", "", str,
            "Name under which the model is listed; empty: the GGUF file name of llama-server's model."),
    Setting("model_tag", "latest", str,
            "Tag appended to the model name on the Ollama routes."),
    Setting("ollama_version", "0.12.3", _dotted_version,
            "Version reported by GET /api/version (plain dotted integers)."),
    Setting("log_level", "INFO", _log_level,
            "Log level: DEBUG, INFO, WARNING or ERROR."),
)


class Settings:
    """Parsed settings, read as attributes (``settings.slot_dir``)."""

    def __init__(self, values: Mapping[str, Any]):
        self.__dict__.update(values)

    def __repr__(self) -> str:
        shown = {k: ("***" if k == "admin_token" and v else v) for k, v in self.__dict__.items()}
        return f"Settings({shown})"


def load_settings(environ: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Read every setting from ``environ`` (default: the process environment).

    ``overrides`` take setting names (``slot_dir``) and are used as given,
    which is how tests build an app without touching the environment.
    """
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.name in overrides:
            values[setting.name] = overrides.pop(setting.name)
            continue
        raw = environ.get(setting.env, setting.default)
        try:
            values[setting.name] = setting.parse(raw)
        except (ValueError, re.error) as exc:
            raise ConfigError(f"{setting.env}={raw!r} is invalid: {exc}") from None
    if overrides:
        raise ConfigError("unknown settings: " + ", ".join(sorted(overrides)))
    return Settings(values)


def markdown_table() -> str:
    """The README's configuration table."""
    rows = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    for setting in SETTINGS:
        default = f"`{setting.default}`" if setting.default else "(empty)"
        rows.append(f"| `{setting.env}` | {default} | {setting.help} |")
    return "\n".join(rows)
