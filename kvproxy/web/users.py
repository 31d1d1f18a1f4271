"""Who a request comes from: the user of its API key, or, without keys, the client.

With client API keys set (``KVPROXY_API_KEYS``, ``KVPROXY_API_KEYS_FILE``), the routes the
table (``kvproxy.routes``) gives to keys need one, sent as llama-server's own ``--api-key``
takes it: ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic SDKs). The
gate (``kvproxy.web.gate``) checks it before the request and leaves the key's user in the
request (``USER``), which scopes every session the request names (``identity.scoped``).

Without keys, sessions named without an id are scoped by the client: its address (the
last address in ``X-Forwarded-For`` that is not a proxy of ``KVPROXY_FORWARDED_ALLOW_IPS``,
as gunicorn trusts them) and its ``User-Agent``.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
from typing import Mapping

from flask import request


USER = "kvproxy.user"  # the request's user, in the WSGI environ


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


def request_user() -> str | None:
    """The user whose key the gate found in this request (None: no keys, or the admin
    token on a route that takes either)."""
    return request.environ.get(USER)


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


def client_address(environ: Mapping[str, str], forwarded_allow_ips: str) -> str:
    """The client's address: the peer's, or behind a trusted proxy (``forwarded_allow_ips``,
    the setting) the last address of ``X-Forwarded-For`` that is not itself a trusted proxy."""
    peer = environ.get("REMOTE_ADDR") or ""
    proxies = _trusted_proxies(forwarded_allow_ips)
    if not _trusted(peer, proxies):
        return peer
    hops = [h.strip() for h in environ.get("HTTP_X_FORWARDED_FOR", "").split(",") if h.strip()]
    for hop in reversed(hops):
        if not _trusted(hop, proxies):
            return hop
    return hops[0] if hops else peer
