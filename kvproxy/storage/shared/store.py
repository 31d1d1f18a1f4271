"""This node's side of the shared store: where it is, and the uploader that fills it.

Built once per process from the settings (``KVPROXY_STORE_URL``; None when it is empty) and
handed to every model's ``ChunkedFiles``, which tells it of each packed save.
"""
from __future__ import annotations

from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation
from kvproxy.storage.shared.uploader import Uploader


class SharedStore:
    """The bucket and this process's upload queue."""

    def __init__(self, bucket: Bucket, queue: int = 256):
        self.bucket = bucket
        self.uploader = Uploader(bucket, queue)

    @classmethod
    def of(cls, settings) -> "SharedStore | None":
        if not getattr(settings, "store_url", ""):
            return None
        return cls(Bucket(StoreLocation.parse(settings.store_url), settings.store_timeout),
                   settings.store_queue)

    @property
    def url(self) -> str:
        return self.bucket.location.url

    def saved(self, files, stem: str) -> None:
        """A save of ``stem`` was packed in ``files``' slot folder."""
        self.uploader.saved(files, stem)

    def problem(self) -> str | None:
        return self.uploader.problem()

    def close(self, timeout: float = 5) -> None:
        self.uploader.close(timeout)
