"""The S3 bucket of the shared store: the one place kvproxy talks to it (boto3).

The endpoint and credentials come only from boto3's own chain (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles), so an
operator configures kvproxy as every other S3 client. Every call is bounded (connect and read
timeouts, at most ``ATTEMPTS`` tries), and every boto3/botocore error becomes a ``StoreError``
here, its message made of the operation, the error's code and status: never the store's own
text, which may quote the access key.

Conditional writes carry the store's concurrency: ``put_if_absent`` (``If-None-Match: *``,
412 when the key exists: first writer wins) for chunks, ``replace`` (``If-Match`` on the
ETag, or ``If-None-Match: *`` for a first write) for sessions.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlsplit

import boto3
import botocore.exceptions
from botocore.config import Config

from kvproxy.errors import StoreError, StoreUnavailable
from kvproxy.storage.shared.location import StoreLocation

ATTEMPTS = 3
DENIED = {"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken",
          "ExpiredToken", "AuthorizationHeaderMalformed", "InvalidSecurity"}
UNREACHABLE = (botocore.exceptions.EndpointConnectionError,
               botocore.exceptions.ConnectTimeoutError, botocore.exceptions.ReadTimeoutError,
               botocore.exceptions.ConnectionClosedError, botocore.exceptions.ConnectionError)
NO_CREDENTIALS = ("no credentials for the shared store: set AWS_ACCESS_KEY_ID and "
                  "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for kvproxy")


@dataclass(frozen=True)
class Head:
    """What HEAD tells of an object."""

    etag: str
    size: int
    metadata: dict


@dataclass(frozen=True)
class Listed:
    """One object of a listing: its name, size, ETag and when it was last written (seconds
    since the epoch, by the store's clock)."""

    key: str
    size: int
    etag: str
    modified: float


def endpoint_shown() -> str:
    """The endpoint as a message may name it: scheme, host and port only."""
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    if not url:
        return "the default S3 endpoint"
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


def s3_client(timeout: float):
    """A boto3 S3 client with kvproxy's bounds; path-style addressing when an endpoint is
    set (what S3-compatible stores such as SeaweedFS and MinIO expect)."""
    custom = bool(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    config = Config(connect_timeout=timeout, read_timeout=timeout,
                    retries={"max_attempts": ATTEMPTS, "mode": "standard"},
                    max_pool_connections=16,
                    s3={"addressing_style": "path" if custom else "auto"})
    return boto3.session.Session().client("s3", config=config)


class Bucket:
    """The shared store's bucket: bounded calls, kvproxy's errors."""

    def __init__(self, location: StoreLocation, timeout: float = 10, client=None):
        self.location = location
        self.timeout = timeout
        self._client = client

    @property
    def client(self):
        """Made on first use, so a kvproxy with an unreachable store still starts."""
        if self._client is None:
            with self.mapped("connect"):
                self._client = s3_client(self.timeout)
        return self._client

    # -- the boundary --------------------------------------------------------------
    @contextlib.contextmanager
    def mapped(self, operation: str, key: str = "") -> Iterator[None]:
        """boto3 and botocore errors of ``operation`` as kvproxy's ``StoreError``."""
        try:
            yield
        except StoreError:
            raise
        except botocore.exceptions.ClientError as exc:
            raise self.refused(operation, key, exc) from None
        except botocore.exceptions.NoCredentialsError:
            raise StoreError(NO_CREDENTIALS) from None
        except UNREACHABLE as exc:
            raise StoreUnavailable(f"cannot reach the shared store at {endpoint_shown()} "
                                   f"({type(exc).__name__}): is it running?") from None
        except (botocore.exceptions.BotoCoreError, ValueError) as exc:
            raise StoreError(f"{operation} in the shared store failed: "
                             f"{type(exc).__name__}") from None

    def refused(self, operation: str, key: str, exc: botocore.exceptions.ClientError
                ) -> StoreError:
        """The error of an answer the store gave, from its code and status alone."""
        error = exc.response.get("Error") or {}
        code = str(error.get("Code") or "")
        status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
        where = f"{operation} {key}".strip()
        if code in DENIED or status == 403:
            return StoreError(f"the shared store refused {where} ({code or status}): check "
                              f"kvproxy's AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY and "
                              f"their rights on bucket {self.location.bucket}")
        if code == "NoSuchBucket":
            return StoreError(f"bucket {self.location.bucket} does not exist at "
                              f"{endpoint_shown()}: create it, or fix KVPROXY_STORE_URL")
        if status >= 500 or code in ("SlowDown", "ServiceUnavailable", "RequestTimeout"):
            return StoreUnavailable(f"the shared store failed {where}: {code or status}")
        return StoreError(f"the shared store answered {where} with {code or status}")

    @staticmethod
    def status_of(exc: botocore.exceptions.ClientError) -> int:
        return (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0

    # -- the calls -----------------------------------------------------------------
    def put_if_absent(self, key: str, body: bytes, metadata: dict | None = None) -> bool:
        """Write ``key`` unless it exists: True when this call wrote it, False when it was
        there already (412: the first writer won)."""
        with self.mapped("put", key):
            try:
                self.client.put_object(Bucket=self.location.bucket, Key=key, Body=body,
                                       IfNoneMatch="*", Metadata=metadata or {})
            except botocore.exceptions.ClientError as exc:
                if self.status_of(exc) == 412:
                    return False
                raise
        return True

    def replace(self, key: str, body: bytes, etag: str | None, metadata: dict | None = None
                ) -> bool:
        """Write ``key`` only over the object of ``etag`` (``None``: only when there is
        none); False when another write came first (412)."""
        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        with self.mapped("put", key):
            try:
                self.client.put_object(Bucket=self.location.bucket, Key=key, Body=body,
                                       Metadata=metadata or {}, **condition)
            except botocore.exceptions.ClientError as exc:
                if self.status_of(exc) == 412:
                    return False
                raise
        return True

    def put(self, key: str, body: bytes) -> None:
        with self.mapped("put", key):
            self.client.put_object(Bucket=self.location.bucket, Key=key, Body=body)

    def get(self, key: str) -> tuple[bytes, Head] | None:
        """The object's bytes and head, None when there is none."""
        with self.mapped("get", key):
            try:
                answer = self.client.get_object(Bucket=self.location.bucket, Key=key)
            except botocore.exceptions.ClientError as exc:
                if self.status_of(exc) == 404 or \
                        (exc.response.get("Error") or {}).get("Code") == "NoSuchKey":
                    return None
                raise
            body = answer["Body"].read()
        return body, Head(answer.get("ETag", ""), len(body), answer.get("Metadata") or {})

    def head(self, key: str) -> Head | None:
        with self.mapped("head", key):
            try:
                answer = self.client.head_object(Bucket=self.location.bucket, Key=key)
            except botocore.exceptions.ClientError as exc:
                if self.status_of(exc) == 404:
                    return None
                raise
        return Head(answer.get("ETag", ""), int(answer.get("ContentLength") or 0),
                    answer.get("Metadata") or {})

    def delete(self, key: str) -> None:
        with self.mapped("delete", key):
            self.client.delete_object(Bucket=self.location.bucket, Key=key)

    def keys(self, prefix: str) -> Iterator[tuple[str, int]]:
        """Every key under ``prefix`` and its size, page by page."""
        with self.mapped("list", prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=prefix)
            for page in pages:
                for item in page.get("Contents") or ():
                    yield item["Key"], int(item.get("Size") or 0)

    def listing(self, prefix: str) -> list[Listed]:
        """Every object under ``prefix``, whole: a page that fails fails the listing, so no
        caller acts on part of one."""
        with self.mapped("list", prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=prefix)
            return [Listed(item["Key"], int(item.get("Size") or 0), item.get("ETag", ""),
                           item["LastModified"].timestamp())
                    for page in pages for item in page.get("Contents") or ()]

    def reachable(self) -> None:
        """``StoreError`` unless the bucket answers (HEAD bucket)."""
        with self.mapped("head bucket"):
            try:
                self.client.head_bucket(Bucket=self.location.bucket)
            except botocore.exceptions.ClientError as exc:
                if self.status_of(exc) == 404:
                    raise StoreError(f"bucket {self.location.bucket} does not exist at "
                                     f"{endpoint_shown()}: create it, or fix "
                                     "KVPROXY_STORE_URL") from None
                raise
