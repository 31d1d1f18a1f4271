"""A lease in the bucket: one object whose holder, alone among the nodes, may run a job (the
sweep) until its expiry.

Taken with a conditional PUT: ``If-None-Match: *`` when there is none, ``If-Match`` on the
ETag of an expired one (or one this node holds), so of nodes racing for it exactly one wins
(412 for the others). Released by writing it expired, again conditional on the ETag this node
wrote: a release never undoes another node's lease, even one taken after ours ran out. The
expiry is by the nodes' clocks (kept by NTP, as the sessions' generations).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

from kvproxy.storage.shared.bucket import Bucket


@dataclass(frozen=True)
class Holder:
    """What a lease object says."""

    node: str
    expires: float

    def encode(self) -> bytes:
        return json.dumps({"node": self.node, "expires": round(self.expires, 3)}).encode()


def decode(data: bytes) -> Holder | None:
    """The lease's holder; None when it cannot be read (then it is treated as expired, so a
    damaged lease never stops every node for good)."""
    try:
        body = json.loads(data)
        return Holder(str(body["node"]), float(body["expires"]))
    except (ValueError, KeyError, TypeError):
        return None


class Lease:
    """``name``'s lease for ``node``, held ``seconds`` at a time."""

    def __init__(self, bucket: Bucket, name: str, node: str, seconds: float,
                 clock: Callable[[], float] = time.time):
        self.bucket = bucket
        self.key = bucket.location.lease(name)
        self.node = node
        self.seconds = seconds
        self.clock = clock
        self._etag: str | None = None
        self._expires = 0.0
        self.other: Holder | None = None   # who held it when ``take`` failed

    def take(self) -> bool:
        """Whether this node holds the lease now (``StoreError`` when the store fails)."""
        now = self.clock()
        found = self.bucket.get(self.key)
        etag = None
        if found is not None:
            holder = decode(found[0])
            if holder is not None and holder.node != self.node and holder.expires > now:
                self.other = holder
                return False
            etag = found[1].etag
        mine = Holder(self.node, now + self.seconds)
        body = mine.encode()
        if not self.bucket.replace(self.key, body, etag):
            self.other = None   # another node came first
            return False
        written = self.bucket.get(self.key)   # its ETag, for the release
        if written is None or written[0] != body:
            return False
        self._etag, self._expires, self.other = written[1].etag, mine.expires, None
        return True

    def left(self) -> float:
        """Seconds this node still holds the lease (0 when it does not)."""
        return max(0.0, self._expires - self.clock()) if self._etag else 0.0

    def release(self) -> bool:
        """Give the lease up at once (written expired over our own ETag); False when it was
        no longer ours."""
        if self._etag is None:
            return False
        etag, self._etag = self._etag, None
        return self.bucket.replace(self.key, Holder(self.node, 0.0).encode(), etag)
