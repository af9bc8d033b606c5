"""Settings: TOML defaults found from anywhere, environment overrides, clear errors."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_app.errors import SettingsError
from neuron_app.settings import PROJECT_ROOT, get_settings, load_settings


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
        ({"device": "tpu"}, "device", "'auto', 'neuron', 'neuron-emulated', 'cuda' or 'cpu'"),
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


def test_configuration_page_has_a_table_per_group_listing_exactly_its_settings() -> None:
    """docs/configuration.md is the user's reference: one table per settings module, in the order of GROUPS, and a
    new field must be documented in its group's table (and only there)."""
    from neuron_app.settings import GROUPS, Settings

    page = (PROJECT_ROOT / "docs" / "configuration.md").read_text()
    sections = re.split(r"^## ", page, flags=re.MULTILINE)[1:]
    assert [re.search(r"\(settings/groups/(\w+)\.py\)", s.splitlines()[0]).group(1) for s in sections] == [
        g.__module__.rsplit(".", 1)[1] for g in GROUPS
    ]
    for group, section in zip(GROUPS, sections, strict=True):
        listed = re.findall(r"^\| `(\w+)` \| `NEURON_APP_(\w+)` \|", section, flags=re.MULTILINE)
        assert all(env == name.upper() for name, env in listed), listed
        assert [name for name, _ in listed] == list(group.model_fields), group.__name__
    assert set(Settings.model_fields) == {name for g in GROUPS for name in g.model_fields}


# --- unknown NEURON_APP_* variables ------------------------------------------------------------


def test_unknown_variables_are_named_with_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """pydantic-settings ignores a typo'd variable, so the load names it and the setting it probably meant (a
    warning each with strict_env = false; the default refuses, below)."""
    monkeypatch.setenv("NEURON_APP_STRICT_ENV", "false")
    monkeypatch.setenv("NEURON_APP_REPLICA", "2")
    monkeypatch.setenv("NEURON_APP_XYZZY", "1")
    monkeypatch.setenv("NEURON_APP_SETTINGS", str(PROJECT_ROOT / "settings.toml"))  # read by the app, not a field
    monkeypatch.setenv("NEURON_APP_MAX_STEPS", "8")
    with caplog.at_level(logging.WARNING, logger="neuron_app.settings"):
        settings = load_settings()
    assert settings.replicas == 1 and settings.max_steps == 8  # the typo changed nothing
    assert [r.getMessage() for r in caplog.records if r.name == "neuron_app.settings"] == [
        "NEURON_APP_REPLICA is not a setting; did you mean NEURON_APP_REPLICAS?",
        "NEURON_APP_XYZZY is not a setting; see docs/configuration.md",
    ]


def test_strict_env_refuses_unknown_variables_without_showing_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default (strict_env = true) the typo stops the load, as an unknown settings-file key does; the message
    names variables, never their values."""
    monkeypatch.setenv("NEURON_APP_AUTH_PASWORD", "hunter2-secret")
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith("NEURON_APP_AUTH_PASWORD is not a setting; did you mean NEURON_APP_AUTH_PASSWORD?")
    assert "NEURON_APP_STRICT_ENV=false" in message and "hunter2" not in message
    assert load_settings(strict_env=False).auth is None


def test_a_settings_error_also_names_the_unknown_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The typo that probably caused a bad combination is named in the same message."""
    monkeypatch.setenv("NEURON_APP_MAX_STEP", "32")
    monkeypatch.setenv("NEURON_APP_DEFAULT_STEPS", "20")
    with pytest.raises(SettingsError, match="above max_steps") as info:
        load_settings()
    assert "NEURON_APP_MAX_STEP is not a setting; did you mean NEURON_APP_MAX_STEPS?" in str(info.value)


@pytest.mark.parametrize("strict", [False, True], ids=["warning", "strict"])
def test_app_py_names_an_unknown_variable_at_start(tmp_path: Path, strict: bool) -> None:
    """`python app.py` stops with one line naming the variable (strict_env, the default); with strict_env = false it
    prints the warning before anything else.
    (share=true without auth stops the non-strict start right after, before any model work.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    env |= {"NEURON_APP_REPLICA": "2", "NEURON_APP_MODEL": "tiny", "NEURON_APP_CACHE_DIR": str(tmp_path)}
    env |= {} if strict else {"NEURON_APP_STRICT_ENV": "false", "NEURON_APP_SHARE": "true"}
    done = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "app.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    line = "NEURON_APP_REPLICA is not a setting; did you mean NEURON_APP_REPLICAS?"
    if strict:
        assert done.stderr.startswith(f"error: {line}") and len(done.stderr.splitlines()) == 1, done.stderr
    else:
        assert done.stderr.startswith(line) and "error: share=true opens a public link" in done.stderr


def test_tiny_shapes_serves_its_own_shapes_unless_told_otherwise() -> None:
    """With the 4B's stock shapes and prompt length, tiny-shapes serves what it was trained at; set values stay."""
    from neuron_app.settings import MODEL_DEFAULTS, load_settings

    stock = load_settings(model="tiny-shapes")
    assert stock.resolutions == MODEL_DEFAULTS["tiny-shapes"]["resolutions"] and stock.default_resolution == "128x128"
    assert stock.max_sequence_length == 32 and all("background" in p for p in stock.example_prompts)
    chosen = load_settings(
        model="tiny-shapes", resolutions=["64x64"], default_resolution="64x64", max_sequence_length=64
    )
    assert (chosen.resolutions, chosen.max_sequence_length) == (["64x64"], 64)
    assert load_settings().resolutions[0] == "1024x1024"  # the 4B keeps its own


def test_tiny_shapes_examples_and_placeholder_show_the_word_order_it_reads() -> None:
    """The first hour's item 4: with the position before the background tiny-shapes gets the background wrong (4 of
    4), so every example ends with the background or the position after it, and the empty box shows that order."""
    from neuron_app.settings import load_settings

    stock = load_settings(model="tiny-shapes")
    positions = ("on the left", "on the right", "at the top", "at the bottom")
    for prompt in stock.example_prompts:
        tail = prompt.split(" background", 1)
        assert len(tail) == 2 and tail[1].strip() in ("", *positions), prompt
        assert not any(p in tail[0] for p in positions), prompt
    placeholder = stock.prompt_placeholder
    assert placeholder.index("background") < placeholder.index("on the left")
    assert load_settings().prompt_placeholder == "Describe the image, press Enter"  # the 4B's box


# --- the first hour: a missing file, lists in the environment, a misspelled key in a file ---------------------


def test_a_missing_settings_file_is_an_error_naming_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Silently falling back to the built-in defaults (the Hub model, 1024 px) surprises an offline user later."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEURON_APP_SETTINGS", "nosuch.toml")
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert str(tmp_path / "nosuch.toml") in message and "NEURON_APP_SETTINGS" in message
    assert len(message.splitlines()) == 1


@pytest.mark.parametrize("value", ["256x256,128x128", " 256x256 , 128x128 ", '["256x256", "128x128"]'])
def test_lists_in_the_environment_take_json_or_commas(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NEURON_APP_RESOLUTIONS", value)
    monkeypatch.setenv("NEURON_APP_DEFAULT_RESOLUTION", "256x256")
    assert load_settings().resolutions == ["256x256", "128x128"]


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("NEURON_APP_RESOLUTIONS", '["256x256", 128x128]', "NEURON_APP_RESOLUTIONS: not a JSON list or a,b,c"),
        ("NEURON_APP_LORAS", "ghibli=/x.safetensors", "NEURON_APP_LORAS: not JSON (an object)"),
        ("NEURON_APP_RESOLUTIONS", "256x256,100x100", "multiple of 16"),
    ],
)
def test_every_settings_error_from_the_environment_is_one_line(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, fragment: str
) -> None:
    """pydantic-settings raises its own multi-line error for an undecodable value: here it is one line."""
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert fragment in message and len(message.splitlines()) == 1, message


def test_an_unknown_key_in_the_settings_file_gets_did_you_mean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "typo.toml"
    toml.write_text('resoluton = ["64x64"]\nxyzzy = 1\n')
    monkeypatch.setenv("NEURON_APP_SETTINGS", str(toml))
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert "resoluton is not a setting; did you mean resolutions?" in message, message
    assert "xyzzy is not a setting; see docs/configuration.md" in message and str(toml) in message
