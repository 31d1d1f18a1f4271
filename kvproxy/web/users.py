"""Who a request comes from: the user of its API key, or, without keys, the client.

With client API keys set (``KVPROXY_API_KEYS``, ``KVPROXY_API_KEYS_FILE``), every client
route (the OpenAI, Anthropic, Ollama, llama-server and passthrough families of
``kvproxy.routes``) needs one, sent as llama-server's own ``--api-key`` takes it:
``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic SDKs). A missing or
wrong key is a 401 in the route's error shape. The key's user scopes every session the
request names (``identity.scoped``). ``/health``, ``/metrics``, the status page and ``/``
(Ollama's probe, "Ollama is running") need none; the admin API keeps the admin token, and
``GET /api/sessions`` also takes a user's key (it then lists that user's sessions only).
The admin token stands in for a key on the methods that need it (``POST /props``).

Without keys, sessions named without an id are scoped by the client: its address (the
last address in ``X-Forwarded-For`` that is not a proxy of ``KVPROXY_FORWARDED_ALLOW_IPS``,
as gunicorn trusts them) and its ``User-Agent``.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import os
from typing import Mapping

from flask import Flask, current_app, request

from kvproxy import routes
from kvproxy.errors import ClientError

CLIENT_FAMILIES = ("openai", "anthropic", "ollama", "llama-server", "passthrough")
# Says nothing and is how Ollama clients find a server: answered without a key.
OPEN_PATHS = ("/",)
USER = "kvproxy.user"  # the request's user, in the WSGI environ
# As gunicorn.conf.py: the proxies whose X-Forwarded-For is believed.
FORWARDED_ALLOW_IPS_DEFAULT = "127.0.0.1,::1"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def sent_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: ``Authorization: Bearer <key>``, else ``x-api-key``."""
    auth = headers.get("Authorization", "")
    scheme, _, value = auth.strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    key = headers.get("x-api-key", "").strip()
    return key or None


def user_of(key: str | None, keys: Mapping[str, str]) -> str | None:
    """The user whose key ``key`` is, compared in constant time against every key (how long
    it takes says nothing about which key, or how much of one, matched)."""
    if not key:
        return None
    sent = _digest(key)
    found = None
    for known, user in keys.items():
        if hmac.compare_digest(sent, _digest(known)) and found is None:
            found = user
    return found


def _is_admin_token(key: str | None, token: str) -> bool:
    return bool(key and token) and hmac.compare_digest(_digest(key), _digest(token))


def needs_key(route: routes.Route | None, path: str) -> bool:
    return route is not None and route.family in CLIENT_FAMILIES and route.path not in OPEN_PATHS


def check_key() -> None:
    """Before every request: a client route needs a valid key when keys are set."""
    settings = current_app.config["KVPROXY"]
    keys = settings.api_keys
    if not keys:
        return
    route = routes.of_request(request)  # a wrong method stays a 405
    if not needs_key(route, request.path):
        return
    key = sent_key(request.headers)
    user = user_of(key, keys)
    if user is not None:
        request.environ[USER] = user
        return
    if routes.needs_token(route, request.method) and _is_admin_token(key, settings.admin_token):
        return  # the operator's own call (POST /props): no session, no user
    raise ClientError("missing or wrong API key: send 'Authorization: Bearer <key>' or "
                      "'x-api-key: <key>'", 401)


def listing_user() -> str | None:
    """For ``GET /api/sessions``: the user whose key the request carries (None: the admin
    token, or no keys)."""
    keys = current_app.config["KVPROXY"].api_keys
    return user_of(sent_key(request.headers), keys) if keys else None


@functools.lru_cache(maxsize=8)
def _trusted_proxies(setting: str) -> tuple[bool, tuple]:
    """KVPROXY_FORWARDED_ALLOW_IPS as (any address, networks), parsed once per value."""
    entries = [a.strip() for a in setting.split(",") if a.strip()]
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            continue
    return "*" in entries, tuple(networks)


def _trusted(address: str, proxies: tuple[bool, tuple]) -> bool:
    anyone, networks = proxies
    if anyone:
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def client_address(environ: Mapping[str, str]) -> str:
    """The client's address: the peer's, or behind a trusted proxy the last address of
    ``X-Forwarded-For`` that is not itself a trusted proxy."""
    peer = environ.get("REMOTE_ADDR") or ""
    proxies = _trusted_proxies(os.environ.get("KVPROXY_FORWARDED_ALLOW_IPS",
                                              FORWARDED_ALLOW_IPS_DEFAULT))
    if not _trusted(peer, proxies):
        return peer
    hops = [h.strip() for h in environ.get("HTTP_X_FORWARDED_FOR", "").split(",") if h.strip()]
    for hop in reversed(hops):
        if not _trusted(hop, proxies):
            return hop
    return hops[0] if hops else peer


def request_scope() -> tuple[str | None, str | None]:
    """``(user, client)`` of the current request for ``identity.scoped``: the key's user
    when keys are set, else what identifies the client (address and user agent)."""
    if not request:
        return None, None
    if current_app.config["KVPROXY"].api_keys:
        user = request.environ.get(USER)
        if not user:  # never unscoped while keys are set
            raise ClientError("missing or wrong API key: send 'Authorization: Bearer <key>' "
                              "or 'x-api-key: <key>'", 401)
        return user, None
    agent = request.headers.get("User-Agent", "")
    return None, f"{client_address(request.environ)}\x00{agent}"


def init_app(app: Flask) -> None:
    app.before_request(check_key)
