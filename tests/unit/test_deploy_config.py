"""The shipped deployment files agree with kvproxy and with each other.

nginx sites (deploy/nginx/), systemd units and their environment file (deploy/systemd/)
and gunicorn.conf.py: the values that must line up are read from the files themselves.
The live behaviour is tested with a real nginx in tests/deploy/test_deploy_nginx_real.py and
tests/deploy/test_deploy_cluster_real.py.
"""
from __future__ import annotations

import configparser
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

from kvproxy.config import PROCESS_SETTINGS, SETTINGS, load_settings
from kvproxy.launch.processes import REPO_ROOT
from tests.nginx_harness import DEPLOY, Nginx, directive_values, seconds

SITES = ["kvproxy.conf", "kvproxy-cluster.conf"]
UNITS = ["llama-server.service", "kvproxy.service"]
SEAWEEDFS_UNITS = ["seaweedfs-master.service", "seaweedfs-volume.service",
                   "seaweedfs-filer.service", "seaweedfs-s3.service"]
NGINX_DEFAULT_TIMEOUT = 60


def site(name: str) -> str:
    return (DEPLOY / "nginx" / name).read_text()


def gunicorn_settings(monkeypatch, **env) -> dict:
    for key in list(__import__("os").environ):
        if key.startswith("KVPROXY_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return runpy.run_path(str(REPO_ROOT / "gunicorn.conf.py"))


def unit(name: str) -> configparser.ConfigParser:
    """The unit's sections; a directive given twice (EnvironmentFile=) keeps its last value:
    ``directives`` reads them all."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str
    parser.read_string((DEPLOY / "systemd" / name).read_text())
    return parser


def directives(name: str, key: str) -> list[str]:
    """Every value of ``key=`` in the unit, in order."""
    return re.findall(rf"^{key}=(.*)$", (DEPLOY / "systemd" / name).read_text(), re.M)


def env_file() -> dict[str, str]:
    values = {}
    for line in (DEPLOY / "systemd" / "kvproxy.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), line
            values[key] = value
    return values


# nginx ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SITES)
def test_streams_are_passed_on_unbuffered_over_keepalive(name):
    text = site(name)
    assert directive_values(text, "proxy_buffering") == ["off"]
    assert directive_values(text, "gzip") == ["off"]
    assert directive_values(text, "proxy_http_version") == ["1.1"]
    assert 'Connection ""' in directive_values(text, "proxy_set_header")
    assert directive_values(text, "keepalive"), "no idle upstream connections kept"


@pytest.mark.parametrize("name", SITES)
def test_timeouts_outlast_kvproxys_own(name):
    """nginx waits longer than kvproxy ever stays silent (waiting for the slot, saving the
    session it held, restoring the next, then waiting for llama-server), so a long prefill is
    answered, or kvproxy answers the error itself."""
    settings = load_settings({})
    longest_silence = (settings.lock_timeout + 2 * settings.slot_action_timeout
                       + settings.read_timeout)
    text = site(name)
    for directive in ("proxy_read_timeout", "proxy_send_timeout"):
        (value,) = directive_values(text, directive)
        assert seconds(value) > longest_silence > NGINX_DEFAULT_TIMEOUT, (directive, value)


@pytest.mark.parametrize("name", SITES)
def test_nginx_closes_idle_upstream_connections_before_gunicorn(name, monkeypatch):
    """Otherwise a POST can be written into a connection gunicorn is closing: a 502 that,
    in the cluster, also marks the machine down."""
    (value,) = directive_values(site(name), "keepalive_timeout")
    assert seconds(value) < gunicorn_settings(monkeypatch)["keepalive"]


@pytest.mark.parametrize("name", SITES)
def test_body_limit_and_admin_routes(name):
    text = site(name)
    limit_mb = load_settings({}).max_body_mb
    assert directive_values(text, "client_max_body_size") == [f"{limit_mb:g}m"]
    assert text.count(f"larger than {limit_mb:g} MiB") == 3, "every API's 413 names the limit"
    assert directive_values(text, "error_page") == ["413 @body_too_large"]
    assert "location @body_too_large {" in text
    pattern, admin = re.search(r"location ~ (\S+) \{(.*?)\}", text, re.S).groups()
    assert "deny all;" in admin and "allow 127.0.0.1;" in admin
    local_only = ["/api/sessions", "/api/sessions/a%2Fb", "/api/slots", "/api/status", "/status",
                  "/slots", "/slots/0"]
    anywhere = ["/api/chat", "/api/tags", "/api/show", "/v1/chat/completions", "/health",
                "/metrics", "/static/status.js", "/api/statuses", "/slotsx"]
    assert [p for p in local_only if not re.search(pattern, p)] == []
    assert [p for p in anywhere if re.search(pattern, p)] == []


def test_cluster_hashes_on_the_session_headers_in_kvproxys_order():
    """The map chain tries the headers in the order kvproxy reads them, then the address."""
    text = site("kvproxy-cluster.conf")
    (balance,) = directive_values(text, "hash")
    assert balance.endswith(" consistent")
    maps = {m.group(2): (m.group(1), m.group(3), m.group(4)) for m in re.finditer(
        r'map \$(\S+) \$(\S+) \{\s*""\s+(\S+);\s*default\s+(\S+);\s*\}', text)}
    variable, order = balance.split()[0].lstrip("$"), []
    while variable in maps:
        header, fallback, value = maps[variable]
        assert value == "$" + header
        order.append(header)
        variable = fallback.lstrip("$")
    assert variable == "remote_addr"
    expected = [h.lower().replace("-", "_") for h in load_settings({}).session_headers]
    assert order == ["http_" + h for h in expected]


def test_cluster_never_sends_a_post_twice_and_5xx_does_not_mark_down():
    text = site("kvproxy-cluster.conf")
    (next_upstream,) = directive_values(text, "proxy_next_upstream")
    assert set(next_upstream.split()) == {"error", "timeout"}
    for line in re.findall(r"^\s*server\s+[^\s{]+[^;]*;", text, re.M):
        assert "max_fails=" in line and "fail_timeout=" in line


@pytest.mark.parametrize("name", SITES)
def test_nginx_accepts_the_site(name, tmp_path):
    upstreams = ["127.0.0.1:1", "127.0.0.1:2"][: 1 if name == "kvproxy.conf" else 2]
    Nginx(tmp_path, name, upstreams).check()


# gunicorn ------------------------------------------------------------------------------

def test_gunicorn_process_settings(monkeypatch):
    defaults = gunicorn_settings(monkeypatch)
    assert defaults["worker_class"] == "kvproxy.web.worker.ReceivingWorker" and defaults["workers"] == 1
    assert defaults["forwarded_allow_ips"] == "127.0.0.1,::1"
    custom = gunicorn_settings(monkeypatch, KVPROXY_GRACEFUL_TIMEOUT="300",
                               KVPROXY_FORWARDED_ALLOW_IPS="10.0.0.5", KVPROXY_KEEPALIVE="90")
    assert (custom["graceful_timeout"], custom["forwarded_allow_ips"], custom["keepalive"]) \
        == (300, "10.0.0.5", 90)


# systemd -------------------------------------------------------------------------------

def test_units_share_user_folder_and_settings():
    llama, proxy = unit("llama-server.service"), unit("kvproxy.service")
    for name, parsed in (("llama-server.service", llama), ("kvproxy.service", proxy)):
        service = parsed["Service"]
        assert service["User"] == service["Group"] == "kvproxy"
        assert service["CacheDirectory"] == "llama-slots"
        # the hot copies' folder in memory, written by llama-server, outlives either's restart
        assert (service["RuntimeDirectory"], service["RuntimeDirectoryPreserve"]) \
            == ("kvproxy-hot", "yes")
        assert directives(name, "EnvironmentFile")[0] == "/etc/kvproxy/kvproxy.env"
        assert service["Restart"] == "on-failure"
        assert service["KillSignal"] == "SIGTERM"
        assert parsed["Install"]["WantedBy"] == "multi-user.target"
    env = env_file()
    assert env["KVPROXY_SLOT_DIR"] == "/var/cache/llama-slots"
    assert env["KVPROXY_HOT_DIR"] == "/run/kvproxy-hot"
    assert "--slot-save-path ${KVPROXY_SLOT_DIR}" in llama["Service"]["ExecStart"]
    assert env["KVPROXY_UPSTREAM"] == f"http://127.0.0.1:{env['LLAMA_PORT']}"
    assert "--port ${LLAMA_PORT}" in llama["Service"]["ExecStart"]
    assert "-np ${LLAMA_SLOTS}" in llama["Service"]["ExecStart"] and int(env["LLAMA_SLOTS"]) >= 1
    # kvproxy pins every request to a slot: llama-server's own similarity pick stays off.
    assert "--slot-prompt-similarity 0" in llama["Service"]["ExecStart"]
    assert "--swa-full" in llama["Service"]["ExecStart"], "sliding-window models restore"


def test_kvproxy_starts_after_and_stops_before_llama_server():
    """It needs llama-server on the way out, to save the session each slot holds, also when
    only llama-server is stopped or restarted (PartOf)."""
    unit_section = unit("kvproxy.service")["Unit"]
    assert "llama-server.service" in unit_section["After"].split()
    assert "llama-server.service" in unit_section["Wants"].split()
    assert "llama-server.service" in unit_section["PartOf"].split()


def test_stop_timeout_covers_the_graceful_stop_and_the_save(monkeypatch):
    env = env_file()
    graceful = gunicorn_settings(monkeypatch, KVPROXY_GRACEFUL_TIMEOUT=env["KVPROXY_GRACEFUL_TIMEOUT"]
                                 )["graceful_timeout"]
    stop = int(unit("kvproxy.service")["Service"]["TimeoutStopSec"])
    assert stop >= graceful + 30, "no time left to save the active session"
    assert unit("kvproxy.service")["Service"]["KillMode"] == "mixed"
    # A reload (HUP) would run two workers over the one slot for a while: restart instead.
    assert "ExecReload" not in unit("kvproxy.service")["Service"]


def test_environment_file_names_only_known_settings():
    known = {s.env for s in SETTINGS + PROCESS_SETTINGS}
    gunicorn_conf = (REPO_ROOT / "gunicorn.conf.py").read_text()
    for key in env_file():
        if key.startswith("KVPROXY_"):
            assert key in known or f"'{key}'" in gunicorn_conf or f'"{key}"' in gunicorn_conf, key
    # Every value the file sets parses, and is what kvproxy then runs with (an empty value:
    # the setting's default).
    settings = load_settings({k: v for k, v in env_file().items() if k.startswith("KVPROXY_")})
    for setting in SETTINGS:
        value = env_file().get(setting.env)
        if value is not None:
            assert getattr(settings, setting.name) == setting.parse(value or setting.default), \
                setting.env


def test_systemd_analyze_verify(tmp_path):
    """systemd's own checker, on copies whose program paths point at stand-ins (it checks
    that they exist); any message at all fails the test."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd); "
                    "the units are still checked by the tests above")
    stand_ins = {"/usr/local/bin/llama-server": tmp_path / "llama-server",
                 "/opt/kvproxy/.venv/bin/gunicorn": tmp_path / "gunicorn",
                 "/usr/local/bin/weed": tmp_path / "weed"}
    for path in stand_ins.values():
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    copies = []
    for name in UNITS + SEAWEEDFS_UNITS:
        text = (DEPLOY / "systemd" / name).read_text()
        for real, stand_in in stand_ins.items():
            text = text.replace(real, str(stand_in))
        (tmp_path / name).write_text(text)
        copies.append(str(tmp_path / name))
    result = subprocess.run([analyze, "verify", "--man=no", *copies], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
        result.stdout + result.stderr
