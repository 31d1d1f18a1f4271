"""The shipped SeaweedFS set-up (deploy/systemd/seaweedfs-*.service, seaweedfs.env,
kvproxy-store.env and deploy/seaweedfs/s3.json) agrees with weed, with kvproxy and with
itself: every flag a unit passes is one its ``weed`` command takes, every variable it uses is
set, the ports line up, no real secret is shipped, and the identity file, filled in, lets
kvproxy's key pass ``kvproxy doctor``'s bucket checks on a real SeaweedFS and nothing more."""
from __future__ import annotations

import configparser
import json
import re
import secrets
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvproxy.config import load_settings
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation
from kvproxy.storage.shared.probe import probe
from tests.nginx_harness import DEPLOY
from kvproxy.launch.seaweed import MISSING, WeedMini, weed_binary

SYSTEMD = DEPLOY / "systemd"
COMMANDS = {"master": "seaweedfs-master.service", "volume": "seaweedfs-volume.service",
            "filer": "seaweedfs-filer.service", "s3": "seaweedfs-s3.service"}
IDENTITIES = DEPLOY / "seaweedfs" / "s3.json"


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str
    parser.read_string((SYSTEMD / name).read_text())
    return parser


def env_file(name: str) -> dict[str, str]:
    values = {}
    for line in (SYSTEMD / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), line
            values[key] = value
    return values


def exec_start(name: str) -> list[str]:
    """The unit's ExecStart split into words (continuation lines joined)."""
    return unit(name)["Service"]["ExecStart"].replace("\\\n", " ").split()


def flags(words: list[str]) -> dict[str, str]:
    """``-name=value`` words of a command line as {name: value}."""
    out = {}
    for word in words:
        if word.startswith("-"):
            name, _, value = word.lstrip("-").partition("=")
            out[name] = value
    return out


def weed_flags(command: str) -> set[str]:
    """The flags ``weed <command> -h`` lists."""
    binary = weed_binary()
    if binary is None:
        pytest.skip(MISSING)
    result = subprocess.run([binary, command, "-h"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"^\s+-([\w.]+)", result.stdout + result.stderr, re.M))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_is_one_weed_takes(command):
    words = exec_start(COMMANDS[command])
    assert words[:2] == ["/usr/local/bin/weed", command]
    known = weed_flags(command)
    assert known, f"weed {command} -h listed no flags"
    assert set(flags(words)) - known == set()


@pytest.mark.parametrize("name", sorted(COMMANDS.values()))
def test_units_run_unprivileged_restart_and_keep_data_in_var_lib(name):
    service = unit(name)["Service"]
    assert service["User"] == service["Group"] == "seaweedfs"
    assert service["Restart"] == "on-failure"
    assert service["EnvironmentFile"] == "/etc/seaweedfs/seaweedfs.env"
    assert service["ProtectSystem"] == "strict" and service["NoNewPrivileges"] == "yes"
    state = service["StateDirectory"]
    assert state.startswith("seaweedfs/")
    own = "/var/lib/" + state
    assert service["WorkingDirectory"] == own
    # Every folder a unit writes is its own state folder, the only one ProtectSystem leaves it.
    paths = [v for v in flags(exec_start(name)).values() if v.startswith("/var/")]
    assert all(p == own for p in paths), paths
    assert unit(name)["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.parametrize("name", sorted(COMMANDS.values()))
def test_every_variable_a_unit_uses_is_set(name):
    used = set(re.findall(r"\$\{(\w+)\}", unit(name)["Service"]["ExecStart"]))
    assert used and used <= set(env_file("seaweedfs.env")), used - set(env_file("seaweedfs.env"))


def test_ports_line_up():
    env = env_file("seaweedfs.env")
    ports = {cmd: int(flags(exec_start(name))["port"]) for cmd, name in COMMANDS.items()}
    assert len(set(ports.values())) == 4
    # gRPC listens on port + 10000: none of them may meet another's HTTP port either
    assert not {p + 10000 for p in ports.values()} & set(ports.values())
    llama_port = int(env_file("kvproxy.env")["LLAMA_PORT"])
    assert llama_port not in ports.values(), "a SeaweedFS machine may also run llama-server"
    masters = env["SEAWEEDFS_MASTERS"].split(",")
    assert {a.rsplit(":", 1)[1] for a in masters} == {str(ports["master"])}
    filers = env["SEAWEEDFS_FILERS"].split(",")
    assert {a.rsplit(":", 1)[1] for a in filers} == {str(ports["filer"])}
    assert filers[0].rsplit(":", 1)[0] == env["SEAWEEDFS_IP"], "this machine's filer first"
    assert env["SEAWEEDFS_IP"] in env["SEAWEEDFS_MASTERS"]
    assert re.fullmatch(r"\d{3}", env["SEAWEEDFS_REPLICATION"])
    endpoint = urlsplit(env_file("kvproxy-store.env")["AWS_ENDPOINT_URL"])
    assert endpoint.port == ports["s3"]
    assert "-config=/etc/seaweedfs/s3.json" in exec_start(COMMANDS["s3"])


def test_store_settings_reach_kvproxy_alone_and_ship_no_secret():
    proxy = (SYSTEMD / "kvproxy.service").read_text()
    assert re.search(r"^EnvironmentFile=-/etc/kvproxy/store.env$", proxy, re.M)
    assert "store.env" not in (SYSTEMD / "llama-server.service").read_text()
    env = env_file("kvproxy-store.env")
    assert set(env) - {"KVPROXY_STORE_URL"} <= {k for k in env if k.startswith("AWS_")}
    assert env["AWS_ACCESS_KEY_ID"] == env["AWS_SECRET_ACCESS_KEY"] == ""
    settings = load_settings({"KVPROXY_STORE_URL": env["KVPROXY_STORE_URL"]})
    assert settings.store_url == env["KVPROXY_STORE_URL"]


def test_identity_file_ships_placeholders_and_scopes_kvproxy_to_its_bucket():
    identities = {i["name"]: i for i in json.loads(IDENTITIES.read_text())["identities"]}
    for identity in identities.values():
        for credential in identity["credentials"]:
            assert re.fullmatch(r"REPLACE-[A-Z-]+", credential["accessKey"])
            assert re.fullmatch(r"REPLACE-[A-Z-]+", credential["secretKey"])
    bucket = StoreLocation.parse(env_file("kvproxy-store.env")["KVPROXY_STORE_URL"]).bucket
    assert sorted(identities["kvproxy"]["actions"]) == \
        sorted(f"{a}:{bucket}" for a in ("Read", "List", "Write"))
    assert "anonymous" not in identities


def filled_identities(path: Path) -> dict[str, tuple[str, str]]:
    """The shipped identity file with fresh keys in place of its placeholders, written to
    ``path``, as the guide's install step does: name -> (access key, secret key)."""
    data = json.loads(IDENTITIES.read_text())
    keys = {}
    for identity in data["identities"]:
        for credential in identity["credentials"]:
            credential["accessKey"] = identity["name"] + "-" + secrets.token_hex(8)
            credential["secretKey"] = secrets.token_hex(20)
            keys[identity["name"]] = (credential["accessKey"], credential["secretKey"])
    path.write_text(json.dumps(data))
    return keys


class ConfiguredWeed(WeedMini):
    """``weed mini`` whose S3 gateway reads an identity file, as the shipped s3 unit does."""

    def __init__(self, data_dir: Path, log_path: Path, identities: Path):
        super().__init__(data_dir, log_path)
        self.identities = identities

    def command(self, binary: str) -> list[str]:
        return super().command(binary) + [f"-s3.config={self.identities}"]


def test_filled_identity_file_passes_doctor_for_kvproxys_bucket_only(tmp_path, monkeypatch):
    if weed_binary() is None:
        pytest.skip(MISSING)
    keys = filled_identities(tmp_path / "s3.json")
    server = ConfiguredWeed(tmp_path / "data", tmp_path / "weed.log", tmp_path / "s3.json")
    server.access_key, server.secret_key = keys["admin"]
    server.start()
    try:
        location = StoreLocation.parse(env_file("kvproxy-store.env")["KVPROXY_STORE_URL"])
        server.client().create_bucket(Bucket=location.bucket)   # the guide's step, as admin
        server.client().create_bucket(Bucket="someone-else")
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["kvproxy"][0])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["kvproxy"][1])
        found = probe(Bucket(location, 10))
        assert [(f.name, f.ok) for f in found] == \
            [("store", True), ("store writes", True), ("store conditions", True)], found
        other = probe(Bucket(StoreLocation.parse("s3://someone-else/prod"), 10))
        assert [(f.name, f.ok) for f in other] == [("store", False)], other
        assert "(403)" in other[0].text
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secrets.token_hex(20))
        assert [(f.name, f.ok) for f in probe(Bucket(location, 10))] == [("store", False)]
    finally:
        server.stop()
