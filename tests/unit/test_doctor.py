"""``kvproxy doctor``'s verdicts against the stubbed llama-server, and ``kvproxy serve``'s
hand-over to gunicorn."""
from __future__ import annotations

import struct

import pytest
import responses

from kvproxy.config import load_settings
from kvproxy.ops import cli, doctor
from kvproxy.slots.restore_probe import ProbeVerdict
from tests.fake_llama import UPSTREAM

HONOURED = ProbeVerdict(True, 180, 179, "k=f16 v=f16 v_trans=0 layers=30 rot=0,0",
                        "179 of 180 restored tokens reused")
NOT_HONOURED = ProbeVerdict(False, 145, 0, "k=f16 v=f16", "0 of 145 restored tokens reused")


def gguf_file(path, arch: str, window: int | None = None):
    """A GGUF header with the architecture (and a sliding window) only."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()
    keys = [string("general.architecture") + struct.pack("<I", 8) + string(arch)]
    if window:
        keys.append(string(f"{arch}.attention.sliding_window") + struct.pack("<II", 4, window))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(keys)) + b"".join(keys))
    return str(path)


@pytest.fixture
def probe(monkeypatch):
    """The restore probe's verdict (the stub does not answer a generation after a restore)."""
    verdicts = {"next": HONOURED}
    monkeypatch.setattr(doctor, "prove_restores", lambda switch, client: verdicts["next"])
    return verdicts


def diagnose(tmp_path, flags=None, **settings):
    checks = doctor.diagnose(load_settings({}, {"upstream": UPSTREAM, "slot_dir": str(tmp_path),
                                                **settings}),
                             flags, wait=1)
    return doctor.exit_status(checks), {c.name: c for c in checks}


def test_a_good_llama_server_passes_every_check(fake, probe, tmp_path):
    gguf_path = gguf_file(tmp_path / "model.gguf", "llama")
    fake.props["model_path"] = gguf_path
    status, checks = diagnose(tmp_path, doctor.Flags(["--slot-save-path", str(tmp_path)]))
    assert status == 0, [c.line() for c in checks.values()]
    assert {"reachable", "api key", "router mode", "slots", "slot listing", "slot saving",
            "slot folder", "context", "ram cache", "kv cache", "restores", "sliding window",
            "hybrid model", "sleep mode"} <= set(checks)
    assert "179 of 180" in checks["restores"].text and "k=f16" in checks["kv cache"].text
    assert [("save", a[1]) for a in fake.actions if a[0] == "save"]   # the probe save ran


def test_unreachable_llama_server_is_a_failure_naming_the_option(tmp_path):
    status, checks = diagnose(tmp_path, upstream="http://127.0.0.1:9")
    assert status == 2 and checks["reachable"].level == doctor.FAIL
    assert "--upstream" in checks["reachable"].text


def test_an_api_key_is_a_failure(fake, tmp_path):
    fake.mock.replace(responses.GET, f"{UPSTREAM}/props", status=401,
                      json={"error": {"code": 401, "message": "Invalid API Key"}})
    status, checks = diagnose(tmp_path)
    assert status == 2 and "KVPROXY_UPSTREAM_API_KEY" in checks["api key"].text


def test_slot_saving_off_is_a_failure_naming_the_folder(fake, probe, tmp_path):
    fake.saving_off = True
    status, checks = diagnose(tmp_path)
    assert status == 2
    assert checks["slot saving"].level == doctor.FAIL
    assert f"--slot-save-path {tmp_path}" in checks["slot saving"].text
    assert checks["restores"].level == doctor.SKIP


def test_a_slot_folder_kvproxy_cannot_use_is_a_failure(fake, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, checks = diagnose(tmp_path, slot_dir=str(blocker / "slots"))
    assert status == 2 and "KVPROXY_SLOT_DIR" in checks["slot folder"].text


def test_a_sliding_window_model_without_swa_full_is_a_warning_naming_the_flag(fake, probe,
                                                                              tmp_path):
    fake.props["model_path"] = gguf_file(tmp_path / "gemma.gguf", "gemma3", window=512)
    probe["next"] = NOT_HONOURED
    status, checks = diagnose(tmp_path)
    assert status == 1
    assert checks["restores"].level == doctor.WARN
    assert checks["sliding window"].level == doctor.WARN
    assert "--swa-full" in checks["sliding window"].text
    probe["next"] = HONOURED   # the same model with --swa-full
    status, checks = diagnose(tmp_path, doctor.Flags(["--swa-full"]))
    assert status == 0 and "--swa-full" in checks["sliding window"].text


def test_a_hybrid_model_is_a_warning(fake, probe, tmp_path):
    fake.props["model_path"] = gguf_file(tmp_path / "mamba.gguf", "mamba2")
    probe["next"] = NOT_HONOURED
    status, checks = diagnose(tmp_path)
    assert status == 1 and "recurrent" in checks["hybrid model"].text


def test_several_slots_want_the_ram_cache_and_similarity_pick_off(fake, probe, tmp_path):
    fake.props["total_slots"] = 2
    fake.held = [0, 0]
    status, checks = diagnose(tmp_path, doctor.Flags(["-np", "2"]))
    assert status == 1 and "--cache-ram 0 --slot-prompt-similarity 0" in checks["ram cache"].text
    status, checks = diagnose(tmp_path, doctor.Flags(["-np", "2", "--cache-ram", "0",
                                                      "--slot-prompt-similarity", "0"]))
    assert status == 0, checks["ram cache"].line()
    status, checks = diagnose(tmp_path)   # flags not readable: said, not guessed
    assert checks["ram cache"].level == doctor.SKIP


def test_several_slots_in_one_unified_kv_pool_are_a_warning(fake, probe, tmp_path):
    """Idle residents slow the active slot only in a unified pool (docs/benchmark.md)."""
    fake.props["total_slots"] = 4
    fake.held = [0, 0, 0, 0]
    quiet = ["--cache-ram", "0", "--slot-prompt-similarity", "0"]
    for unified in (["-np", "4", "--kv-unified"], quiet[:0], ["-np", "4", "-kvu"]):
        status, checks = diagnose(tmp_path, doctor.Flags(unified + quiet))
        assert status == 1 and checks["kv layout"].level == doctor.WARN, unified
        assert "without --kv-unified" in checks["kv layout"].text
    for own in (["-np", "4"], ["--parallel", "4", "--kv-unified", "--no-kv-unified"]):
        status, checks = diagnose(tmp_path, doctor.Flags(own + quiet))
        assert status == 0 and checks["kv layout"].level == doctor.OK, own
    fake.props["total_slots"] = 1
    fake.held = [0]
    assert "kv layout" not in diagnose(tmp_path, doctor.Flags([]))[1]


def test_sleep_mode_is_a_warning(fake, probe, tmp_path):
    fake.props["is_sleeping"] = True
    status, checks = diagnose(tmp_path)
    assert status == 1 and "--sleep-idle-seconds" in checks["sleep mode"].text
    fake.props["is_sleeping"] = False
    status, checks = diagnose(tmp_path, doctor.Flags(["--sleep-idle-seconds", "300"]))
    assert status == 1


def test_router_mode_is_supported_and_its_folder_read_from_the_flags(fake, tmp_path):
    fake.props["role"] = "router"
    status, checks = diagnose(tmp_path, doctor.Flags(["--models-dir", "/m",
                                                      "--slot-save-path", str(tmp_path)]))
    assert status == 0 and checks["router mode"].level == doctor.OK
    status, checks = diagnose(tmp_path, doctor.Flags(["--models-dir", "/m"]))
    assert status == 2 and "--slot-save-path" in checks["slot saving"].text
    status, checks = diagnose(tmp_path, doctor.Flags(["--slot-save-path", "/elsewhere"]))
    assert status == 2 and "/elsewhere" in checks["slot folder"].text


def test_flags_of_the_local_llama_server_on_the_upstream_port(tmp_path):
    for pid, args in (("12", ["/usr/bin/llama-server", "-m", "a.gguf", "--port", "8081",
                              "--swa-full"]),
                      ("13", ["/usr/bin/llama-server", "-m", "b.gguf"]),
                      ("14", ["python3", "--port", "8082"])):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes("\0".join(args).encode() + b"\0")
    flags = doctor.local_flags("http://127.0.0.1:8081", proc=tmp_path)
    assert flags is not None and flags.has("--swa-full")
    assert doctor.local_flags("http://localhost:8080", proc=tmp_path).value("-m") == "b.gguf"
    assert doctor.local_flags("http://127.0.0.1:8082", proc=tmp_path) is None
    assert doctor.local_flags("http://203.0.113.9:8081", proc=tmp_path) is None


def test_the_command_prints_a_line_per_check_and_exits_with_the_verdict(fake, probe, tmp_path,
                                                                          capsys):
    fake.saving_off = True
    code = cli.main(["doctor", "--upstream", UPSTREAM, "--slot-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2 and not err
    assert any(line.startswith("FAIL  slot saving") for line in out.splitlines())
    assert out.splitlines()[-1] == doctor.VERDICTS[2]


def test_version(capsys):
    import kvproxy
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"kvproxy {kvproxy.__version__}\n"


def test_serve_refuses_a_bad_option_in_one_line_before_gunicorn(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli.os, "execve", lambda *a: pytest.fail("gunicorn started"))
    assert cli.main(["serve", "--slot-dir", str(tmp_path), "--port", "http"]) == cli.USAGE
    err = capsys.readouterr().err
    assert err.startswith("kvproxy: KVPROXY_PORT='http' is invalid") and err.count("\n") == 1


def test_serve_becomes_gunicorn_with_the_package_settings_and_the_options(tmp_path,
                                                                          monkeypatch):
    started = {}
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: started.update(
        argv=argv, env=env))
    monkeypatch.setenv("KVPROXY_LOCK_TIMEOUT", "77")
    cli.main(["serve", "--upstream", "http://10.0.0.2:8080", "--slot-dir", str(tmp_path),
              "--port", "11500"])
    assert started["argv"][1:] == ["-m", "gunicorn", "-c", "python:kvproxy.gunicorn_conf",
                                   "kvproxy.wsgi:app"]
    env = started["env"]
    assert (env["KVPROXY_UPSTREAM"], env["KVPROXY_SLOT_DIR"], env["KVPROXY_PORT"],
            env["KVPROXY_LOCK_TIMEOUT"]) == ("http://10.0.0.2:8080", str(tmp_path), "11500", "77")


def test_serve_help_lists_every_setting_with_its_variable_and_default(capsys):
    from kvproxy.config import PROCESS_SETTINGS, SETTINGS
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for setting in SETTINGS + PROCESS_SETTINGS:
        assert "--" + setting.name.replace("_", "-") in out and setting.env in out
