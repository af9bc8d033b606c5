"""Where settings come from (settings.toml, `NEURON_APP_*`, code), said in one line when it goes wrong:
the file named by `NEURON_APP_SETTINGS` must exist, lists in the environment take JSON or `a,b,c`, an unknown key
in a file gets "did you mean", and the file may hold no secret."""

from __future__ import annotations

import difflib
import json
import os
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource, TomlConfigSettingsSource

from neuron_app.errors import SettingsError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ENV_PREFIX = "NEURON_APP_"
SETTINGS_FILE_ENV = "NEURON_APP_SETTINGS"
#: `NEURON_APP_*` variables the app reads that are not settings (the rest must name a setting).
NON_SETTING_VARS = (SETTINGS_FILE_ENV,)
SECRET_FIELDS = (
    "auth_username",
    "auth_password",
    "hf_token",
    "api_key",
    "api_keys",
    "c2pa_key_passphrase",
    "webhook_secret",
    "watermark_secret",
    "cache_remote_secret",
)


def check_settings_file(path: Path, variable: str) -> Path:
    """A settings file that was asked for by name must be there: the built-in defaults instead would be a surprise
    found at the first click (the Hub model, 1024 px shapes)."""
    if not path.is_file():
        raise SettingsError(f"{variable}={path}: no such settings file (unset {variable} for settings.toml)")
    return path


def _is_list(field: FieldInfo) -> bool:
    return typing.get_origin(field.annotation) is list


class FriendlyEnvSource(EnvSettingsSource):
    """The environment, where a list may also be written `256x256,128x128` and a value that is neither JSON nor
    that is one line naming its variable (pydantic-settings raises a 30-line traceback)."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except json.JSONDecodeError:
            if _is_list(field) and isinstance(value, str) and not value.lstrip().startswith(("[", "{")):
                return [item.strip() for item in value.split(",") if item.strip()]
            variable = f"{self.env_prefix}{field_name}".upper()
            shape = "a JSON list or a,b,c" if _is_list(field) else "JSON (an object)"
            raise SettingsError(f"{variable}: not {shape}: {json_error(value)}") from None


def json_error(value: Any) -> str:
    """Where a JSON text breaks, without echoing it (it may hold a key)."""
    try:
        json.loads(value)
    except json.JSONDecodeError as exc:
        return f"{exc.msg} at character {exc.pos}"
    return "not the expected shape"


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """The hint for an unknown settings key: the closest setting's name, or where the list of settings is."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"did you mean {close[0]}?" if close else "see docs/configuration.md"


def settings_file() -> Path:
    """The TOML file in force: `$NEURON_APP_SETTINGS`, else `settings.toml` at the project root."""
    override = os.environ.get(SETTINGS_FILE_ENV)
    if not override:
        return PROJECT_ROOT / "settings.toml"
    return check_settings_file(Path(override).expanduser().resolve(), SETTINGS_FILE_ENV)


class _TomlWithoutSecrets(TomlConfigSettingsSource):
    """The TOML source, refusing secrets: a committed file must never hold a password."""

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        leaked = sorted(set(data) & set(SECRET_FIELDS))
        if leaked:
            raise SettingsError(
                f"{settings_file()}: {', '.join(leaked)} must not be set in the settings file; "
                f"use the environment ({', '.join(ENV_PREFIX + k.upper() for k in leaked)})"
            )
        return data
