"""Loading the settings: one readable line for what is wrong, and a name for every unknown `NEURON_APP_*`."""

from __future__ import annotations

import difflib
import functools
import logging
import os
import tomllib
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError as PydanticSettingsError

from neuron_app.errors import SettingsError, one_line
from neuron_app.settings.core import Settings
from neuron_app.settings.sources import ENV_PREFIX, NON_SETTING_VARS, did_you_mean, settings_file

#: The settings' log name, as before they were a package (log filters name it).
log = logging.getLogger("neuron_app.settings")


def unknown_env_vars(environ: dict[str, str] | None = None) -> list[str]:
    """One line per `NEURON_APP_*` variable that is not a setting, with the closest setting's variable.

    pydantic-settings ignores such variables, so a typo (`NEURON_APP_REPLICA=2`) would change nothing and say
    nothing. Names only: values may be secrets.
    """
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields} | set(NON_SETTING_VARS)
    suffixes = {k.removeprefix(ENV_PREFIX): k for k in known}
    lines = []
    for name in sorted(os.environ if environ is None else environ):
        upper = name.upper()  # pydantic-settings matches variable names case-insensitively
        if not upper.startswith(ENV_PREFIX) or upper in known:
            continue
        close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), suffixes, n=1)
        hint = f"did you mean {suffixes[close[0]]}?" if close else "see docs/configuration.md"
        lines.append(f"{name} is not a setting; {hint}")
    return lines


def _check_env_names(strict: bool) -> None:
    """Unknown `NEURON_APP_*` variables: a warning each, or a `SettingsError` with `strict_env = true`."""
    lines = unknown_env_vars()
    if lines and strict:
        why = " (unknown NEURON_APP_* variables stop the start; NEURON_APP_STRICT_ENV=false lets it go on)"
        raise SettingsError("; ".join(lines) + why)
    for line in lines:
        log.warning("%s", line)


def load_settings(**overrides: Any) -> Settings:
    """Build settings, turning validation errors into one readable `SettingsError`; unknown variables are named."""
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(settings)"
            env = f"{ENV_PREFIX}{field.split('.')[0].upper()}" if err["loc"] else "NEURON_APP_*"
            if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:  # only a file or code can pass one
                hint = did_you_mean(field, Settings.model_fields)
                lines.append(f"{field} is not a setting; {hint} (in {settings_file()})")
                continue
            lines.append(f"{field}: {err['msg']} (from {settings_file()} or ${env})")
        raise SettingsError("invalid settings - " + "; ".join(lines + unknown_env_vars())) from None
    except tomllib.TOMLDecodeError as exc:  # a typo in the file: where, in TOML's words ("Unclosed array ...")
        raise SettingsError(f"{settings_file()} is not valid TOML: {exc}") from None
    except PydanticSettingsError as exc:  # a source that could not read a value: its reason, on one line
        cause = f": {one_line(exc.__cause__)}" if exc.__cause__ else ""
        raise SettingsError(f"invalid settings - {exc}{cause}") from None
    _check_env_names(settings.strict_env)
    return settings


@functools.cache
def get_settings() -> Settings:
    """The process-wide settings; tests call `get_settings.cache_clear()` after changing the environment."""
    return load_settings()
