"""Run the shipped nginx configs for tests: only addresses are changed, nothing else.

``render_site`` takes a file from deploy/nginx/ and points its ``listen`` and its
upstream ``server`` lines at test ports (the parameters of the first ``server`` line,
such as max_fails, are kept for every address). ``Nginx`` runs it as a child process
(``daemon off``, its own prefix, logs and temp folders in a temporary folder) on a free
port, and stops it with the test. ``Cluster`` is the shipped cluster site in front of
named kvproxy + llama-server pairs, as the cluster tests run it.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx2
import pytest
import requests
from requests.adapters import HTTPAdapter

from kvproxy.launch.processes import REPO_ROOT, free_port, stop_process

DEPLOY = REPO_ROOT / "deploy"
SERVER_LINE = re.compile(r"^(\s*)server\s+([^\s{;]+)([^;]*);[^\n]*\n", re.M)
LISTEN_LINE = re.compile(r"^(\s*)listen\s+[^;]+;", re.M)


def light_stack(tmp: Path, llama_args: dict | None = None, **proxy_env: str):
    """A llama-server + kvproxy pair whose llama-server uses one thread: several test servers
    on a shared 2-core machine slow each other down badly with llama.cpp's spinning threads."""
    from tests.conftest import Stack
    stack = Stack(tmp, llama_args=llama_args, **proxy_env)
    stack.llama.extra_args += ["-t", "1"]
    return stack


def kill_pair(pair) -> None:
    """A machine lost at once: SIGKILL to kvproxy's process group (gunicorn's master and
    worker, so no exit save) and to llama-server's, both reaped before returning."""
    for process in (pair.proxy.process, pair.llama.process):
        if process is None:
            continue
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(10)


def nginx_binary() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if path is None:
        pytest.skip("nginx is not installed: run 'make test-deploy' (installs Debian's nginx)")
    return path


def render_site(text: str, listen: str, upstreams: list[str],
                overrides: dict[str, str] | None = None) -> str:
    """The shipped site with its listen address and upstream servers replaced.

    ``overrides`` replaces the value of a directive everywhere it appears; only the
    control experiments use it (to show what the shipped values prevent).
    """
    servers = list(SERVER_LINE.finditer(text))
    assert servers, "no upstream server line found"
    indent, _, params = servers[0].groups()
    block = "".join(f"{indent}server {address}{params};\n" for address in upstreams)
    text = text[:servers[0].start()] + block + SERVER_LINE.sub("", text[servers[0].end():])
    text, count = LISTEN_LINE.subn(lambda m: f"{m.group(1)}listen {listen};", text)
    assert count == 1, "expected one listen line"
    for name, value in (overrides or {}).items():
        text, count = re.subn(rf"^(\s*){re.escape(name)}\s+[^;]*;", rf"\g<1>{name} {value};",
                              text, flags=re.M)
        assert count, f"{name} is not in the shipped config"
    return text


def directive_values(text: str, name: str) -> list[str]:
    """Every value of a directive in a config (comments removed)."""
    text = re.sub(r"#[^\n]*", "", text)
    return [m.group(1).strip() for m in re.finditer(rf"(?:^|[;{{}}\s]){re.escape(name)}\s+([^;]*);",
                                                    text)]


def seconds(value: str) -> float:
    """An nginx time value (``1800s``, ``5m``, ``60``) in seconds."""
    match = re.fullmatch(r"(\d+)(ms|s|m|h)?", value.strip())
    assert match, value
    factor = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[match.group(2)]
    return int(match.group(1)) * factor


MAIN_CONF = """\
{user}worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 512; }}
http {{
    log_format upstream '$remote_addr "$request" $status upstream=$upstream_addr '
                        'upstream_status=$upstream_status time=$request_time';
    access_log {tmp}/access.log upstream;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {site};
}}
"""


class Nginx:
    """nginx in the foreground serving one rendered site on a free loopback port."""

    def __init__(self, tmp: Path, shipped: str, upstreams: list[str],
                 overrides: dict[str, str] | None = None):
        self.tmp = tmp
        self.port = free_port()
        self.shipped = DEPLOY / "nginx" / shipped
        site = render_site(self.shipped.read_text(), f"127.0.0.1:{self.port}", upstreams, overrides)
        (tmp / "site.conf").write_text(site)
        # As root nginx would run its workers as nobody, who cannot enter pytest's folders.
        user = "user root root;\n" if os.geteuid() == 0 else ""
        (tmp / "nginx.conf").write_text(MAIN_CONF.format(user=user, tmp=tmp, site=tmp / "site.conf"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, *extra: str) -> list[str]:
        return [nginx_binary(), "-p", str(self.tmp), "-c", str(self.tmp / "nginx.conf"),
                "-e", str(self.tmp / "error.log"), *extra]

    def check(self) -> None:
        """``nginx -t``: the rendered config is valid."""
        result = subprocess.run(self.command("-t"), capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr

    def start(self, timeout: float = 20) -> "Nginx":
        self.check()
        self.process = subprocess.Popen(self.command("-g", "daemon off;"), start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.error_log()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError("nginx did not listen in time")

    def stop(self) -> None:
        stop_process(self.process, 10)

    def error_log(self) -> str:
        path = self.tmp / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def access_log(self) -> str:
        path = self.tmp / "access.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> "Nginx":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SourceAddressAdapter(HTTPAdapter):
    """requests from a chosen loopback address (127.0.0.2, ...), as if from another client."""

    def __init__(self, address: str):
        self.address = address
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self.address, 0)
        super().init_poolmanager(*args, **kwargs)


def session_from(address: str) -> requests.Session:
    session = requests.Session()
    session.mount("http://", SourceAddressAdapter(address))
    return session


def httpx_client_from(address: str, timeout: float = 300) -> httpx2.Client:
    """An HTTP client of the kind the openai and anthropic libraries use (httpx2), bound to ``address``."""
    return httpx2.Client(transport=httpx2.HTTPTransport(local_address=address), timeout=timeout)


class Cluster:
    """The shipped deploy/nginx/kvproxy-cluster.conf in front of kvproxy + llama-server pairs
    (``light_stack``), one per name, each with its own slot folder under ``tmp/<name>``;
    ``proxy_env`` and ``llama_args`` go to every pair. Every reply names its pair in
    X-KVProxy-Node."""

    def __init__(self, tmp: Path, names: tuple[str, ...] = ("node-a", "node-b"),
                 llama_args: dict | None = None, **proxy_env: str):
        self.tmp = tmp
        self.llama_args = llama_args
        self.proxy_env = proxy_env
        self.pairs = {name: self.new_pair(name) for name in names}

    def new_pair(self, name: str):
        return light_stack(self.tmp / name, self.llama_args, KVPROXY_NODE_NAME=name,
                           **self.proxy_env)

    def start(self) -> "Cluster":
        try:
            for pair in self.pairs.values():
                pair.start()
            self.nginx = Nginx(self.tmp, "kvproxy-cluster.conf", self.upstreams()).start()
        except BaseException:
            self.stop()
            raise
        return self

    def upstreams(self) -> list[str]:
        return [f"127.0.0.1:{pair.proxy.port}" for pair in self.pairs.values()]

    def fail_timeout(self) -> float:
        """Seconds nginx skips a machine that refused a connection (the shipped value)."""
        (value,) = set(re.findall(r"fail_timeout=(\w+)", self.nginx.shipped.read_text()))
        return seconds(value)

    def replace(self, lost: str, name: str):
        """A new pair ``name`` with an empty slot folder where the pair ``lost`` was: its
        kvproxy on the same address, so nginx sends it ``lost``'s sessions again."""
        pair = self.new_pair(name)
        pair.proxy.port = self.pairs[lost].proxy.port
        self.pairs[name] = pair
        return pair.start()

    def stop(self) -> None:
        nginx = getattr(self, "nginx", None)
        if nginx:
            nginx.stop()
        for pair in self.pairs.values():
            pair.stop()


def node_of(url: str, session: str) -> str:
    """The machine nginx sends a session to (a GET answers at once, whatever the load)."""
    reply = requests.get(url + "/health", headers={"X-Session-Id": session}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.headers["X-KVProxy-Node"]
