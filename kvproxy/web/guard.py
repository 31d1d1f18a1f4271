"""Browsers cannot act for the operator: Host names, cross-site requests, admin content types.

Checked before every request by the gate (``kvproxy.web.gate``), after who may call, in
the route family's error shape (``kvproxy.web.errors``):

- ``Host`` must be a name kvproxy answers to: a loopback name (``localhost``,
  ``*.localhost``), an IP address, this machine's host name or ``KVPROXY_ALLOWED_HOSTS``.
  A page whose own name was rebound to kvproxy's address (DNS rebinding) sends its own
  name, and is refused (403).
- A browser request from a page on another site is refused (403) on every route that
  changes something (any method but GET, HEAD and OPTIONS: chats, admin actions) and on
  the whole admin API, unless its ``Origin`` is in ``KVPROXY_ALLOWED_ORIGINS``. The
  browser says where a request comes from in ``Sec-Fetch-Site``; browsers that do not
  send it are judged by ``Origin`` against ``Host``. Servers, SDKs and curl send neither
  and are not affected.
- An admin POST must be JSON (``Content-Type: application/json``, else 415), or have no
  body and no content type at all (``curl -X POST``): a form or a ``text/plain`` body is
  what a page on another site can send without asking.
"""
from __future__ import annotations

import ipaddress
import socket
from functools import lru_cache
from typing import Callable, Iterable
from urllib.parse import urlsplit

from kvproxy import routes
from kvproxy.errors import ClientError

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
DEFAULT_PORTS = {"http": 80, "https": 443}


@lru_cache(maxsize=1)
def this_machine() -> str:
    return socket.gethostname().lower().rstrip(".")


def split_host(value: str) -> tuple[str, int | None]:
    """A Host header's name (lower case, IPv6 without brackets) and port, if any."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:
        name, port = value, ""
    return name.rstrip("."), int(port) if port.isdigit() else None


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    name, _ = split_host(host)
    allowed = [a.lower().rstrip(".") for a in allowed]
    if "*" in allowed or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name == this_machine():
        return True
    return any(name == a or (a.startswith(".") and (name.endswith(a) or name == a[1:]))
               for a in allowed)


def _origin_matches_host(origin: str, host: str) -> bool:
    parts = urlsplit(origin)
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return False
    try:
        origin_port = parts.port or DEFAULT_PORTS[parts.scheme]
    except ValueError:
        return False
    name, port = split_host(host)
    # A proxy may pass the name without the port (nginx's $host): the name must agree.
    return parts.hostname.lower().rstrip(".") == name and port in (None, origin_port)


def cross_site(headers, host: str, allowed_origins: Iterable[str]) -> str | None:
    """Why a request comes from a page on another site, or None when it does not (or comes
    from no browser at all)."""
    origin = headers.get("Origin")
    allowed = list(allowed_origins)
    if origin and ("*" in allowed or origin.rstrip("/").lower() in
                   (a.rstrip("/").lower() for a in allowed)):
        return None
    site = headers.get("Sec-Fetch-Site")
    if site is not None:
        if site.strip().lower() in ("same-origin", "none"):
            return None
        return f"a page on {origin or 'another site'} ({site})"
    if origin is None:
        return None
    if origin != "null" and host and _origin_matches_host(origin, host):
        return None
    return f"a page on {origin}"


def check(request, route: routes.Route | None, answers_to: Callable[[str], bool],
          allowed_origins: Iterable[str]) -> None:
    """``request`` to ``route`` (the one its path matches, None: no route), with the
    settings' hosts (``answers_to``: ``host_allowed`` bound to them) and origins."""
    host = request.headers.get("Host", "")
    if host and not answers_to(host):
        raise ClientError(f"kvproxy does not answer to the host name {host!r}: add it to "
                          "KVPROXY_ALLOWED_HOSTS", 403)
    admin = route is not None and route.family == "admin"
    if request.method not in SAFE_METHODS or admin:
        source = cross_site(request.headers, host, allowed_origins)
        if source:
            raise ClientError(f"{request.method} {request.path} from {source} is refused: "
                              "add its origin to KVPROXY_ALLOWED_ORIGINS to allow it", 403)
    if admin and request.method == "POST" and request.mimetype != "application/json" \
            and not _empty_without_type(request):
        raise ClientError(f"POST {request.path} needs 'Content-Type: application/json'", 415)


def _empty_without_type(request) -> bool:
    """A POST with no body and no content type: what curl and scripts send for an action
    without arguments. A page can send it too, but a browser then names the page (``Origin``,
    ``Sec-Fetch-Site``), which ``cross_site`` has already judged."""
    return not request.headers.get("Content-Type") and not request.content_length \
        and "Transfer-Encoding" not in request.headers
