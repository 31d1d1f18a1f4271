"""The one check before every request, read from the route table.

In this order, so each answer wins over the next as it always has:

1. the body bound: a body larger than ``KVPROXY_MAX_BODY_MB`` is a 413 before it is read
   (``kvproxy.web.body_limit``);
2. who may call the route (``kvproxy.routes``, ``Route.auth_for``): anyone, a user's key
   (with client API keys set), the admin token (when set), or either; otherwise a 401;
3. the browser guard: host names, cross-site requests, admin content types (403, 415;
   ``kvproxy.web.guard``);
4. a route that reads records (the admin API, ``/status``, ``/metrics``) first waits for
   the replies already sent to be recorded (``kvproxy.web.common``).

Every setting it needs is taken once, when the app is built, so a request costs a few
dictionary lookups here. Failures are raised and rendered by ``kvproxy.web.errors`` in the
route's error shape. Shape: llama-swap's ``apiKeyAuth`` in its ``setupGinEngine``.
"""
from __future__ import annotations

import functools
import hmac
from dataclasses import dataclass
from typing import Callable, Mapping

from flask import Flask, request

from kvproxy import routes
from kvproxy.config import Settings
from kvproxy.errors import MISSING_KEY, ClientError
from kvproxy.web import body_limit, guard, users
from kvproxy.web.common import see_sent_replies

ADMIN_TOKEN = "missing or wrong admin token: send 'Authorization: Bearer <token>'"
CHANGES_FOR_EVERYONE = ("{method} {path} changes llama-server for every client: "
                        "send 'Authorization: Bearer <admin token>'")


@dataclass(frozen=True)
class Credentials:
    """What a caller may prove, from the settings: the admin token's exact header (None
    without a token) and the users' keys (key -> user; empty without keys)."""
    token_header: bytes | None
    keys: Mapping[str, str]

    @classmethod
    def of(cls, settings: Settings) -> "Credentials":
        token = settings.admin_token
        return cls(f"Bearer {token}".encode() if token else None, dict(settings.api_keys))


@dataclass(frozen=True)
class Verdict:
    """The gate's answer on who calls: let in (as ``user``, when a key named one), or
    refused with ``refused`` as the 401's message."""
    user: str | None = None
    refused: str | None = None


LET_IN = Verdict()


def judge(kind: str, credentials: Credentials, headers: Mapping[str, str], method: str,
          path: str, family: str) -> Verdict:
    """Who the request is, for a route of auth ``kind``: a pure decision over its headers."""
    if kind == routes.OPEN:
        return LET_IN
    if kind == routes.KEY:
        if not credentials.keys:
            return LET_IN
        user = users.user_of(users.sent_key(headers), credentials.keys)
        return Verdict(user=user) if user else Verdict(refused=MISSING_KEY)
    if credentials.token_header is None:  # no admin token set: the admin side is open
        return LET_IN
    user = None
    if kind == routes.TOKEN_OR_KEY and credentials.keys:
        user = users.user_of(users.sent_key(headers), credentials.keys)
    sent = headers.get("Authorization", "").encode()
    if hmac.compare_digest(sent, credentials.token_header) or user is not None:
        return Verdict(user=user)
    if family == "admin" or method in ("GET", "HEAD"):
        return Verdict(refused=ADMIN_TOKEN)
    return Verdict(refused=CHANGES_FOR_EVERYONE.format(method=method, path=path))


class Gate:
    """The before-request check of one app, with its settings taken once."""

    def __init__(self, app: Flask, settings: Settings) -> None:
        self._url_map = app.url_map
        self._credentials = Credentials.of(settings)
        self._max_body = body_limit.limit_bytes(settings.max_body_mb)
        self._allowed_origins = tuple(settings.allowed_origins)
        self._host_allowed: Callable[[str], bool] = functools.lru_cache(maxsize=256)(
            functools.partial(guard.host_allowed, allowed=tuple(settings.allowed_hosts)))

    def check(self) -> None:
        """Before every request (see the module's text)."""
        req = request._get_current_object()  # one look through Flask's proxy, not a dozen
        body_limit.refuse_large_bodies(req, self._max_body)
        route = routes.matched(self._url_map, req)  # a wrong method: the path's route
        served = route is not None and req.url_rule is not None  # else a 404 or 405
        if served:
            verdict = judge(route.auth_for(req.method), self._credentials, req.headers,
                            req.method, req.path, route.family)
            if verdict.refused:
                raise ClientError(verdict.refused, 401)
            if verdict.user is not None:
                req.environ[users.USER] = verdict.user
        guard.check(req, route, self._host_allowed, self._allowed_origins)
        if served and route.waits_for_records:
            see_sent_replies()


def init_app(app: Flask, settings: Settings) -> None:
    app.before_request(Gate(app, settings).check)
