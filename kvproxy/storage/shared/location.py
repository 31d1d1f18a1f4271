"""Where the shared store keeps what: the bucket and prefix of ``KVPROXY_STORE_URL``, and each
object's name. Pure.

Users are kept apart by prefix, so a node asks only under its caller's user, and a bucket
policy or a listing can follow users::

    <prefix>/users/<owner tag>/chunks/<key[:2]>/<key>   a chunk, under its chained prefix key
    <prefix>/users/<owner tag>/sessions/<stem>          a session: sidecar + manifest + tail

The owner tag is the one the session's stem starts with (``identity.owner_tag``); files of no
user (kvproxy without API keys) are under ``users/_/``. A chunk key already names the model,
the KV layout and every token before it (``chunks.cut``), so one key is one prefix anywhere.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvproxy.sessions.identity import owner_tag_of

SCHEME = "s3://"
NO_USER = "_"
# S3's rule for bucket names (SeaweedFS and AWS alike): 3 to 63 lower-case letters, digits,
# dots and hyphens, starting and ending with a letter or digit.
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
PREFIX = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")


@dataclass(frozen=True)
class StoreLocation:
    """A bucket and the prefix every object of this kvproxy lives under."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, url: str) -> "StoreLocation":
        """``s3://<bucket>/<prefix>``; ``ValueError`` with the rule otherwise (never echoing
        what came after the scheme: it might hold a credential put there by mistake)."""
        if not url.startswith(SCHEME):
            raise ValueError("expected s3://<bucket>/<prefix>")
        bucket, _, prefix = url[len(SCHEME):].partition("/")
        if "@" in bucket or ":" in bucket:
            raise ValueError("expected s3://<bucket>/<prefix> without credentials or port: the "
                             "endpoint goes in AWS_ENDPOINT_URL, the keys in AWS_ACCESS_KEY_ID "
                             "and AWS_SECRET_ACCESS_KEY")
        if not BUCKET.fullmatch(bucket):
            raise ValueError("the bucket name must be 3 to 63 lower-case letters, digits, dots "
                             "and hyphens")
        prefix = prefix.strip("/")
        if prefix and not PREFIX.fullmatch(prefix):
            raise ValueError("the prefix must be letters, digits and . _ - separated by /")
        return cls(bucket, prefix)

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"

    def _under(self, *parts: str) -> str:
        return "/".join(([self.prefix] if self.prefix else []) + list(parts))

    def users(self) -> str:
        """The prefix of every user's objects, ending with a slash."""
        return self._under("users") + "/"

    def user_prefix(self, user: str) -> str:
        """Everything of one user (``user_of``), ending with a slash."""
        return self._under("users", user) + "/"

    def chunk(self, user: str, key: str) -> str:
        return self.user_prefix(user) + f"chunks/{key[:2]}/{key}"

    def session(self, user: str, stem: str) -> str:
        return self.user_prefix(user) + f"sessions/{stem}"

    def sessions(self, user: str) -> str:
        """The prefix of one user's sessions."""
        return self.user_prefix(user) + "sessions/"

    def lease(self, name: str) -> str:
        """A lease object (``<prefix>/<name>.lease``), apart from every user's."""
        return self._under(f"{name}.lease")

    def kind_of(self, name: str) -> tuple[str, str] | None:
        """The user and kind (``chunks`` or ``sessions``) of an object named under
        ``users()``; None for any other name."""
        if not name.startswith(self.users()):
            return None
        parts = name[len(self.users()):].split("/")
        if len(parts) == 4 and parts[1] == "chunks" or len(parts) == 3 and parts[1] == "sessions":
            return parts[0], parts[1]
        return None

    def probe(self, name: str) -> str:
        """An object ``kvproxy doctor`` writes and deletes again, apart from every user's."""
        return self._under("doctor", name)


def user_of(stem: str) -> str:
    """The user prefix a session's objects go under: its stem's owner tag, else ``_``."""
    return owner_tag_of(stem) or NO_USER
