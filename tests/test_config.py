"""Settings: defaults, validation with one-line errors, and the README table."""
from pathlib import Path

import pytest

from kvproxy.config import SETTINGS, ConfigError, load_settings, markdown_table


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


def test_every_setting_is_in_the_readme():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert markdown_table() in readme, "README's configuration table is out of date"
    for setting in SETTINGS:
        assert f"`{setting.env}`" in readme
