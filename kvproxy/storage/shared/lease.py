"""A lease in the bucket: one object whose holder, alone among the nodes, may run a job (the
sweep) until its expiry.

Taken with a conditional PUT: ``If-None-Match: *`` when there is none, ``If-Match`` on the
ETag of an expired one (or one this node holds), so of nodes racing for it exactly one wins
(412 for the others). Released by writing it expired, again conditional on the ETag this node
wrote: a release never undoes another node's lease, even one taken after ours ran out. The
expiry is by the nodes' clocks (kept by NTP, as the sessions' generations).

Each take writes a serial of its own, kept by its release, so every write of the lease has
an ETag no earlier write had: an upload that reads the lease before and after checking its
chunks (``fence``) can tell that a sweep began or ended in between.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from kvproxy.storage.shared.bucket import Bucket

SWEEP = "sweep"   # the lease of the sweep of unnamed chunks


@dataclass(frozen=True)
class Holder:
    """What a lease object says."""

    node: str
    expires: float
    serial: str = ""   # of the take; its release keeps it

    def encode(self) -> bytes:
        body = {"node": self.node, "expires": round(self.expires, 3)}
        if self.serial:
            body["serial"] = self.serial
        return json.dumps(body).encode()


def decode(data: bytes) -> Holder | None:
    """The lease's holder; None when it cannot be read (then it is treated as expired, so a
    damaged lease never stops every node for good)."""
    try:
        body = json.loads(data)
        return Holder(str(body["node"]), float(body["expires"]), str(body.get("serial", "")))
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Fence:
    """The lease as one look saw it: its ETag (None: never taken) and whether a holder held
    it then. Two looks with equal fences saw no take or release in between."""

    etag: str | None
    held: bool


def fence(bucket: Bucket, name: str, clock: Callable[[], float] = time.time) -> Fence:
    """A look at ``name``'s lease (``StoreError`` when the store fails). A lease that cannot
    be read is not held, as for ``Lease.take``."""
    found = bucket.get(bucket.location.lease(name))
    if found is None:
        return Fence(None, False)
    holder = decode(found[0])
    return Fence(found[1].etag, holder is not None and holder.expires > clock())


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
        self._serial = ""
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
        mine = Holder(self.node, now + self.seconds, uuid.uuid4().hex)
        body = mine.encode()
        if not self.bucket.replace(self.key, body, etag):
            self.other = None   # another node came first
            return False
        written = self.bucket.get(self.key)   # its ETag, for the release
        if written is None or written[0] != body:
            return False
        self._etag, self._expires, self.other = written[1].etag, mine.expires, None
        self._serial = mine.serial
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
        return self.bucket.replace(self.key, Holder(self.node, 0.0, self._serial).encode(),
                                   etag)
