"""Where settings come from, said in one line when it goes wrong: the file named by `NEURON_APP_SETTINGS` must
exist, lists in the environment take JSON or `a,b,c`, and an unknown key in a file gets "did you mean"."""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource

from neuron_app.errors import SettingsError


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
