"""Application settings, grouped by what they configure: `settings.toml` defaults, `NEURON_APP_*` overrides.

Priority (highest first): arguments passed in code, environment, the TOML file. Secrets (auth password, Hub
token, keys) come from the environment only and are `SecretStr`. Each group is a mixin of `Settings` in a module of
its own (model, requests, compile, device, cache, modes, interfaces, trust, replicas, server); the names stay flat
(`NEURON_APP_<FIELD>`), and docs/configuration.md has a table per group.
"""

from __future__ import annotations

from neuron_app.settings.core import Settings
from neuron_app.settings.groups.cache import CacheSettings, parse_s3_url
from neuron_app.settings.groups.compile import CompileSettings
from neuron_app.settings.groups.device import DeviceSettings
from neuron_app.settings.groups.interfaces import DEFAULT_KEY_NAME, MIN_KEY_CHARS, ApiKey, InterfaceSettings
from neuron_app.settings.groups.model import MODEL_DEFAULTS, SHIPPED_MODELS, TINY, ModelSettings, shipped_model
from neuron_app.settings.groups.modes import MAX_REFERENCE_AREA, MIN_REFERENCE_SIDE, ModeSettings
from neuron_app.settings.groups.replicas import ReplicaRange, ReplicaSettings
from neuron_app.settings.groups.requests import RequestSettings
from neuron_app.settings.groups.server import ServerSettings
from neuron_app.settings.groups.trust import TrustSettings
from neuron_app.settings.loading import get_settings, load_settings, unknown_env_vars
from neuron_app.settings.sources import (
    ENV_PREFIX,
    NON_SETTING_VARS,
    PROJECT_ROOT,
    SECRET_FIELDS,
    SETTINGS_FILE_ENV,
    settings_file,
)

#: The groups, in the order docs/configuration.md lists them.
GROUPS = (
    ModelSettings,
    RequestSettings,
    CompileSettings,
    DeviceSettings,
    CacheSettings,
    ModeSettings,
    InterfaceSettings,
    TrustSettings,
    ReplicaSettings,
    ServerSettings,
)

__all__ = [
    "DEFAULT_KEY_NAME",
    "ENV_PREFIX",
    "GROUPS",
    "MAX_REFERENCE_AREA",
    "MIN_KEY_CHARS",
    "MIN_REFERENCE_SIDE",
    "MODEL_DEFAULTS",
    "NON_SETTING_VARS",
    "PROJECT_ROOT",
    "SECRET_FIELDS",
    "SETTINGS_FILE_ENV",
    "SHIPPED_MODELS",
    "TINY",
    "ApiKey",
    "ReplicaRange",
    "Settings",
    "get_settings",
    "load_settings",
    "parse_s3_url",
    "settings_file",
    "shipped_model",
    "unknown_env_vars",
]
