"""Settings: defaults, validation with one-line errors, and the table in docs/configuration.md."""
from pathlib import Path

import pytest

from kvproxy.config import (PROCESS_SETTINGS, SETTINGS, ConfigError, load_process_settings,
                            load_settings, markdown_table)


def test_defaults():
    settings = load_settings({})
    assert settings.upstream == "http://127.0.0.1:8080"
    assert settings.slot_dir == "/var/cache/llama-slots"
    assert settings.admin_token == ""
    assert settings.session_headers[0] == "X-Session-Id"


@pytest.mark.parametrize("env", [
    {"KVPROXY_UPSTREAM": "localhost:8080"},
    {"KVPROXY_LOCK_TIMEOUT": "-1"},
    {"KVPROXY_LOCK_TIMEOUT": "soon"},
    {"KVPROXY_BASE_SNAPSHOTS": "maybe"},
    {"KVPROXY_ANONYMOUS_SESSIONS": "everyone"},
    {"KVPROXY_SIDE_REQUEST_PATTERN": "(unclosed"},
    {"KVPROXY_OLLAMA_VERSION": "v1"},
])
def test_invalid_values_name_the_variable(env):
    with pytest.raises(ConfigError) as caught:
        load_settings(env)
    (name,) = env
    assert str(caught.value).startswith(f"{name}=") and "\n" not in str(caught.value)


def test_every_setting_is_in_the_configuration_page():
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert markdown_table() in page, ("docs/configuration.md's settings table is out of date: "
                                      "paste kvproxy.config.markdown_table() into it")
    for setting in SETTINGS:
        assert f"`{setting.env}`" in page
    assert markdown_table(PROCESS_SETTINGS) in page, (
        "docs/configuration.md's process settings table is out of date: paste "
        "kvproxy.config.markdown_table(PROCESS_SETTINGS) into it")


def test_process_settings_fill_in_their_worked_out_defaults():
    defaults = load_process_settings({})
    assert (defaults.port, defaults.threads, defaults.stop_grace) == (11434, 32, 100.0)
    custom = load_process_settings({"KVPROXY_MAX_WAITERS": "4", "KVPROXY_GRACEFUL_TIMEOUT": "30"})
    assert (custom.threads, custom.stop_grace) == (20, 10.0)
    with pytest.raises(ConfigError, match="^KVPROXY_PORT="):
        load_process_settings({"KVPROXY_PORT": "http"})


@pytest.mark.parametrize("env", [
    {"KVPROXY_LOCK_TIMEOUT": "nan"},
    {"KVPROXY_READ_TIMEOUT": "inf"},
    {"KVPROXY_CONNECT_TIMEOUT": "-inf"},
    {"KVPROXY_LOCK_TIMEOUT": "1e300"},
    {"KVPROXY_LOCK_TIMEOUT": "0"},
    {"KVPROXY_MAX_DISK_GB": "NaN"},
    {"KVPROXY_MIN_FREE_GB": "-1"},
    {"KVPROXY_MIN_FREE_GB": "infinity"},
    {"KVPROXY_SLOT_ID": "-1"},
    {"KVPROXY_SLOT_ID": "99999"},
    {"KVPROXY_RESTORE_MISS_LIMIT": "2.5"},
])
def test_non_finite_and_out_of_range_numbers_are_refused(env):
    (name,) = env
    with pytest.raises(ConfigError) as caught:
        load_settings(env)
    assert str(caught.value).startswith(f"{name}=") and "\n" not in str(caught.value)


def test_numbers_in_range_are_accepted():
    settings = load_settings({"KVPROXY_LOCK_TIMEOUT": "0.5", "KVPROXY_MIN_FREE_GB": "0",
                              "KVPROXY_MAX_DISK_GB": "2.5", "KVPROXY_SLOT_ID": "3"})
    assert (settings.lock_timeout, settings.min_free_gb, settings.max_disk_gb,
            settings.slot_id) == (0.5, 0, 2.5, 3)


def test_a_slot_folder_that_cannot_be_created_names_the_variable(tmp_path):
    from kvproxy import create_app
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError) as caught:
        create_app({"slot_dir": str(tmp_path / "a-file" / "slots")})
    assert str(caught.value).startswith("KVPROXY_SLOT_DIR=") and "\n" not in str(caught.value)


def test_a_slot_folder_that_cannot_be_written_names_the_variable(tmp_path, monkeypatch):
    """Root writes through chmod, so the write itself is made to fail as on a read-only mount."""
    import errno
    import tempfile

    from kvproxy import create_app

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(ConfigError, match=r"^KVPROXY_SLOT_DIR=.*Read-only file system"):
        create_app({"slot_dir": str(tmp_path)})


@pytest.mark.parametrize("env", [{"KVPROXY_LOCK_TIMEOUT": "nan"},
                                 {"KVPROXY_SLOT_DIR": "/proc/kvproxy-cannot-be-here"}])
def test_start_up_prints_one_line_and_exits(env):
    """What gunicorn's worker does on import of wsgi.py: one line, no traceback."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", "import wsgi"], cwd=root, capture_output=True,
                            text=True, timeout=60,
                            env={**os.environ, "KVPROXY_UPSTREAM": "http://127.0.0.1:9", **env})
    (name,) = env
    assert result.returncode == 4, "gunicorn's APP_LOAD_ERROR: its master stops, not retries"
    assert result.stderr.startswith(f"kvproxy: {name}=") and result.stderr.count("\n") == 1, result.stderr


def test_make_run_refuses_a_bad_setting_before_starting_anything(tmp_path):
    """``make run`` (kvproxy.launch.serve) checks settings first: one line, exit 2, no llama-server."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "kvproxy.launch.serve"], cwd=root, capture_output=True,
                            text=True, timeout=60,
                            env={**os.environ, "KVPROXY_SLOT_DIR": str(tmp_path / "slots"),
                                 "KVPROXY_LOG_DIR": str(tmp_path / "log"),
                                 "KVPROXY_MIN_FREE_GB": "inf"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("kvproxy: KVPROXY_MIN_FREE_GB=") and result.stderr.count("\n") == 1


def test_gunicorn_stops_on_a_bad_setting_instead_of_rebooting_its_worker(tmp_path):
    from kvproxy.launch.processes import ProxyServer
    proxy = ProxyServer("http://127.0.0.1:9", str(tmp_path / "slots"), log_path=str(tmp_path / "log"),
                        env={"KVPROXY_LOCK_TIMEOUT": "nan"})
    with pytest.raises(RuntimeError, match="exited with code 4"):
        proxy.start(timeout=60)
    log = (tmp_path / "log").read_text()
    assert [line for line in log.splitlines() if line.startswith("kvproxy: ")] == [
        "kvproxy: KVPROXY_LOCK_TIMEOUT='nan' is invalid: expected a number greater than 0 up to 86400"]
    assert "Traceback" not in log
