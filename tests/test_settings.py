"""Settings: TOML defaults found from anywhere, environment overrides, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_app.settings import PROJECT_ROOT, SettingsError, get_settings, load_settings


def test_defaults_come_from_the_project_toml_from_any_folder(tmp_path: Path) -> None:
    """settings.toml is anchored to the project, not to the current folder."""
    code = "from neuron_app.settings import load_settings; s = load_settings(); print(s.model_dump_json())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(PROJECT_ROOT), "PATH": "/usr/bin:/bin", "HOME": "/home/demo"},
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout)
    assert data["model"] == "black-forest-labs/FLUX.2-klein-4B"
    assert data["default_resolution"] == "1024x1024" and "1024x1024" in data["resolutions"]
    assert data["default_steps"] == 4
    assert data["cache_dir"] == "/home/demo/.cache/neuron-app"  # persistent, never /tmp


def test_environment_overrides_toml_and_lists_are_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_APP_RESOLUTIONS", '["512x512", "768x512"]')
    monkeypatch.setenv("NEURON_APP_DEFAULT_RESOLUTION", "768x512")
    monkeypatch.setenv("NEURON_APP_MAX_STEPS", "8")
    settings = load_settings()
    assert settings.resolutions == ["512x512", "768x512"]
    assert settings.max_steps == 8
    get_settings.cache_clear()
    assert get_settings().default_resolution == "768x512"
    get_settings.cache_clear()


def test_settings_file_can_be_moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other.toml"
    other.write_text('model = "tiny"\nresolutions = ["64x64"]\ndefault_resolution = "64x64"\n')
    monkeypatch.setenv("NEURON_APP_SETTINGS", str(other))
    settings = load_settings()
    assert settings.is_tiny and settings.resolutions == ["64x64"]


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        ({"resolutions": ["1000x1000"], "default_resolution": "1000x1000"}, "resolutions", "multiple of 16"),
        ({"default_resolution": "512x512"}, "default_resolution", "not in resolutions"),
        ({"device": "tpu"}, "device", "'auto', 'neuron', 'cuda' or 'cpu'"),
        ({"default_steps": 20, "max_steps": 8}, "default_steps", "above max_steps"),
    ],
)
def test_bad_settings_fail_with_one_message_naming_field_and_file(overrides: dict, field: str, fragment: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(**overrides)
    message = str(info.value)
    assert fragment in message
    assert "settings.toml" in message and field in message


def test_secrets_are_refused_in_the_settings_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leaky = tmp_path / "leaky.toml"
    leaky.write_text('auth_username = "admin"\nauth_password = "hunter2"\n')
    monkeypatch.setenv("NEURON_APP_SETTINGS", str(leaky))
    with pytest.raises(SettingsError, match="must not be set in the settings file") as info:
        load_settings()
    assert "hunter2" not in str(info.value)


def test_secrets_from_environment_are_secret_str(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_APP_AUTH_USERNAME", "demo")
    monkeypatch.setenv("NEURON_APP_AUTH_PASSWORD", "s3cret-value")
    settings = load_settings()
    assert settings.auth == ("demo", "s3cret-value")
    assert "s3cret-value" not in repr(settings) and "s3cret-value" not in settings.model_dump_json()


def test_readme_configuration_table_lists_every_setting() -> None:
    """docs/configuration.md's table is the user's reference: a new field must be documented there."""
    from neuron_app.settings import Settings

    readme = (PROJECT_ROOT / "docs" / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert f"| `{name}` | `NEURON_APP_{name.upper()}` |" in readme, name
