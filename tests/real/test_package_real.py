"""The package as people install it: the wheel built from the checkout, installed into a fresh
venv outside it, its ``kvproxy`` command run against the real llama-server.

The wheel is built with ``pip wheel --no-deps`` (pip fetches the build backend, or takes it
from its cache) and installed with ``--no-deps``; the new venv sees the packages of the venv
running the tests through a ``.pth`` file, as ``--system-site-packages`` would, so nothing else
is downloaded. Every command runs from a folder outside the checkout, so what it imports is the
installed wheel.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import requests

import kvproxy
from kvproxy.launch.processes import (REPO_ROOT, LlamaServer, free_port, start_process,
                                      stop_process, swa_model)

pytestmark = pytest.mark.real

COMMAND_TIMEOUT = 120


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin folder of a fresh venv with the wheel installed."""
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"   # a copy, so the build leaves nothing in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (source / name).write_bytes((REPO_ROOT / name).read_bytes())
    subprocess.run(["cp", "-r", str(REPO_ROOT / "kvproxy"), str(source / "kvproxy")], check=True,
                   timeout=60)
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist),
                    str(source)], check=True, timeout=300, cwd=tmp)
    wheel, = dist.glob("kvproxy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for packaged in ("kvproxy/templates/status.html", "kvproxy/static/status.js",
                     "kvproxy/static/status.css", "kvproxy/gunicorn_conf.py", "kvproxy/wsgi.py"):
        assert packaged in names, packaged
    assert not any(name.startswith(("tests/", "bench/")) for name in names)

    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True,
                             timeout=30).stdout.strip()
    (Path(purelib) / "outer-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--quiet", str(wheel)], check=True, timeout=300, cwd=tmp)
    where = subprocess.run([str(python), "-c", "import kvproxy; print(kvproxy.__file__)"],
                           capture_output=True, text=True, check=True, timeout=60,
                           cwd=tmp).stdout.strip()
    assert where.startswith(str(env_dir)), where
    return env_dir / "bin"


def kvproxy_command(bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    return subprocess.run([str(bin_dir / "kvproxy"), *args], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT, cwd=bin_dir.parent, env=env)


class NoSlotSaving(LlamaServer):
    """llama-server started without --slot-save-path."""

    def command(self) -> list[str]:
        cmd = super().command()
        at = cmd.index("--slot-save-path")
        return cmd[:at] + cmd[at + 2:]


def test_help_and_version(installed):
    shown = kvproxy_command(installed, "--help")
    assert shown.returncode == 0
    for command in ("serve", "doctor", "ps", "sessions", "rm", "clear", "stats"):
        assert command in shown.stdout
    serve = kvproxy_command(installed, "serve", "--help")
    assert serve.returncode == 0 and "KVPROXY_SLOT_DIR" in serve.stdout and "--port" in serve.stdout
    version = kvproxy_command(installed, "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"kvproxy {kvproxy.__version__}")


def test_doctor_and_serve_with_a_good_llama_server(installed, tmp_path):
    slot_dir = tmp_path / "slots"
    with LlamaServer(str(slot_dir), log_path=str(tmp_path / "llama-server.log")) as llama:
        doctor = kvproxy_command(installed, "doctor", "--upstream", llama.url,
                                 "--slot-dir", str(slot_dir))
        print(doctor.stdout, doctor.stderr)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        lines = doctor.stdout.splitlines()
        assert any(line.startswith("ok") and "slot saving" in line for line in lines)
        assert any(line.startswith("ok") and "restores" in line for line in lines)
        assert not doctor.stderr

        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
        proxy = start_process([str(installed / "kvproxy"), "serve", "--upstream", llama.url,
                               "--slot-dir", str(slot_dir), "--port", str(port)],
                              str(tmp_path / "proxy.log"), f"http://127.0.0.1:{port}/health", 60,
                              cwd=installed.parent, env=env)
        try:
            reply = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                  headers={"X-Session-Id": "installed"}, timeout=120,
                                  json={"messages": [{"role": "user", "content": "Say hi."}],
                                        "max_tokens": 8})
            assert reply.status_code == 200, reply.text
            assert reply.headers["X-KVProxy-Session"] == "installed"
            assert reply.json()["choices"][0]["message"]["content"] is not None
        finally:
            stop_process(proxy, 40)


def test_doctor_fails_without_slot_saving(installed, tmp_path):
    slot_dir = tmp_path / "slots"
    with NoSlotSaving(str(slot_dir), log_path=str(tmp_path / "llama-server.log")) as llama:
        doctor = kvproxy_command(installed, "doctor", "--upstream", llama.url,
                                 "--slot-dir", str(slot_dir))
    print(doctor.stdout, doctor.stderr)
    assert doctor.returncode == 2
    failed = [line for line in doctor.stdout.splitlines() if line.startswith("FAIL")]
    assert failed and "slot saving" in failed[0] and f"--slot-save-path {slot_dir}" in failed[0]


def test_doctor_names_swa_full_for_a_sliding_window_model_without_it(installed, tmp_path):
    slot_dir = tmp_path / "slots"
    with LlamaServer(str(slot_dir), model=swa_model(), swa_full=False,
                     log_path=str(tmp_path / "llama-server.log")) as llama:
        doctor = kvproxy_command(installed, "doctor", "--upstream", llama.url,
                                 "--slot-dir", str(slot_dir))
    print(doctor.stdout, doctor.stderr)
    assert doctor.returncode in (1, 2)
    flagged = [line for line in doctor.stdout.splitlines() if line.startswith(("warn", "FAIL"))]
    assert any("sliding window" in line and "--swa-full" in line for line in flagged)
    assert not doctor.stderr
