"""The one place a request's session is resolved: from its call and its caller.

The session a request names (a header, a body id, the route's own rule for infill and
the Responses API, else its opening messages), scoped by its caller (the user of its API
key, or its client), and for a conversation without an id, followed by what it shares
with this caller's saved conversations (``sessions.matching``, over ``TrailIndex``).
"""
from __future__ import annotations

import dataclasses
import threading

from kvproxy.config import Settings
from kvproxy.relay.context import INFILL, RESPONSES, ChatCall, scope_of
from kvproxy.relay.trails import TrailIndex
from kvproxy.sessions import identity, matching, route_identity
from kvproxy.storage.store import SessionStore

SIDE = identity.Session(identity.SIDE_SESSION, "side-request", persistent=False)


def named_session(call: ChatCall, stream: bool, settings: Settings) -> identity.Session:
    """The session the request names itself, before its caller scopes it."""
    if call.side:
        return SIDE
    if call.kind == INFILL:
        return route_identity.infill_session(call.headers, call.raw, settings.session_headers)
    fields = route_identity.responses_identity_body(call.raw) if call.kind == RESPONSES \
        else call.raw
    return identity.resolve(
        call.headers, fields, call.messages, stream=stream,
        header_names=settings.session_headers,
        anonymous=settings.anonymous_sessions,
        side_pattern=settings.side_request_pattern)


class SessionResolver:
    """Resolves sessions; keeps one trail index per slot folder."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._trails: dict[str, TrailIndex] = {}
        self._lock = threading.Lock()

    def resolve(self, call: ChatCall, stream: bool, store: SessionStore) -> identity.Session:
        """The request's session, as its user (API keys) or its client sees it
        (``identity.scoped``); a conversation without an id is followed by what it shares
        with this user's or client's conversations saved in ``store`` (``matching``)."""
        user, client = scope_of(call.caller, bool(self.settings.api_keys))
        named = named_session(call, stream, self.settings)
        session = identity.scoped(named, user=user, client=client)
        if named.source != "conversation-hash":
            return session
        min_chars = self.settings.match_min_tokens * matching.CHARS_PER_TOKEN
        if min_chars <= 0:
            return session
        index = self.trails_of(store)
        scope = matching.scope_of(user, client)
        trail = matching.trail_of(call.messages, call.body.get("tools"))

        def rescope(session_id: str) -> identity.Session:
            return identity.scoped(dataclasses.replace(named, id=session_id, key=session_id),
                                   user=user, client=client)
        followed = matching.follow(session, trail, index.records(scope), scope, min_chars,
                                   rescope)
        index.note(followed.trail)
        return followed

    def trails_of(self, store: SessionStore) -> TrailIndex:
        """The trail index of ``store``'s folder (one per folder: every model's files), told
        what each model's store writes there."""
        key = str(store.root)
        index = self._trails.get(key)
        if index is None:
            with self._lock:
                index = self._trails.setdefault(key, TrailIndex(store))
        store.tell_sidecar_writes(index.learn, index.forget)
        return index
