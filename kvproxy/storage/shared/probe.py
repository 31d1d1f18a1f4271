"""What ``kvproxy doctor`` asks of the shared store's bucket: does it answer, take a write, and
honour the conditional writes the store's safety rests on (a chunk written twice keeps the
first; a session written over a stale ETag is refused)?

The probes are objects of their own under ``<prefix>/doctor/``, deleted again; no user's
object is touched.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from kvproxy.errors import StoreError
from kvproxy.storage.shared.bucket import Bucket, endpoint_shown


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    text: str


def probe(bucket: Bucket) -> list[Finding]:
    """One finding per question, in order; a question that cannot be asked is not."""
    where = f"bucket {bucket.location.bucket} at {endpoint_shown()}"
    try:
        bucket.reachable()
    except StoreError as exc:
        return [Finding("store", False, str(exc))]
    found = [Finding("store", True, f"{where} answers")]
    name = bucket.location.probe(f"probe-{secrets.token_hex(6)}")
    try:
        try:
            bucket.put(name, b"kvproxy doctor: written")
            body = bucket.get(name)
        except StoreError as exc:
            return found + [Finding("store writes", False, str(exc))]
        if body is None or body[0] != b"kvproxy doctor: written":
            return found + [Finding("store writes", False, f"{where} did not give back what "
                                                         "was written to it")]
        found.append(Finding("store writes", True, f"kvproxy can write and read in {where}"))
        found.append(conditional(bucket, name))
    finally:
        try:
            bucket.delete(name)
        except StoreError:
            pass
    return found


def conditional(bucket: Bucket, name: str) -> Finding:
    """Whether a second put-if-absent and a put over a stale ETag are both refused (412)."""
    try:
        head = bucket.head(name)
        kept_first = not bucket.put_if_absent(name, b"kvproxy doctor: second writer")
        bucket.put(name, b"kvproxy doctor: changed")
        stale_refused = head is not None and not bucket.replace(name, b"kvproxy doctor: stale",
                                                                head.etag)
    except StoreError as exc:
        return Finding("store conditions", False, str(exc))
    if kept_first and stale_refused:
        return Finding("store conditions", True, "conditional writes are honoured "
                                                 "(If-None-Match: *, If-Match): 412 when they fail")
    ignored = " and ".join(n for n, ok in (("If-None-Match: *", kept_first),
                                           ("If-Match", stale_refused)) if not ok)
    return Finding("store conditions", False, f"the store ignores {ignored}: nodes could "
                   "overwrite each other's chunks or newer sessions")
