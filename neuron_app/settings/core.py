"""`Settings`: every group's fields in one pydantic-settings class (NEURON_APP_<FIELD> each), the checks that
span groups, and the shipped models' defaults."""

from __future__ import annotations

from pydantic import model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from neuron_app.settings.groups.cache import CacheSettings
from neuron_app.settings.groups.compile import CompileSettings
from neuron_app.settings.groups.device import DeviceSettings
from neuron_app.settings.groups.interfaces import DEFAULT_KEY_NAME, InterfaceSettings, _check_webhook_secret
from neuron_app.settings.groups.model import MODEL_DEFAULTS, ModelSettings
from neuron_app.settings.groups.modes import ModeSettings
from neuron_app.settings.groups.replicas import ReplicaSettings
from neuron_app.settings.groups.requests import RequestSettings
from neuron_app.settings.groups.server import ServerSettings
from neuron_app.settings.groups.trust import TrustSettings
from neuron_app.settings.sources import ENV_PREFIX, FriendlyEnvSource, _TomlWithoutSecrets, settings_file


class Settings(
    ServerSettings,
    InterfaceSettings,
    TrustSettings,
    ReplicaSettings,
    ModeSettings,
    CacheSettings,
    CompileSettings,
    DeviceSettings,
    RequestSettings,
    ModelSettings,
    BaseSettings,
):
    """One class for the sources (pydantic-settings reads the fields of all the groups): the names stay flat."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = _TomlWithoutSecrets(settings_cls, toml_file=settings_file())
        return (init_settings, FriendlyEnvSource(settings_cls), toml)

    @model_validator(mode="after")
    def _check_consistency(self) -> Settings:
        self._apply_model_defaults()
        if (self.c2pa_cert is None) != (self.c2pa_key is None):
            raise ValueError("c2pa_cert and c2pa_key go together: set both (or neither, for the local chain)")
        if self.default_resolution not in self.resolutions:
            raise ValueError(f"default_resolution {self.default_resolution!r} is not in resolutions {self.resolutions}")
        if self.default_steps > self.max_steps:
            raise ValueError(f"default_steps {self.default_steps} is above max_steps {self.max_steps}")
        for name in self.loras:
            if name.strip() != name or not name or name == "none" or len(name) > 64:
                raise ValueError(
                    f"LoRA name {name!r} is not allowed (1-64 characters, no surrounding spaces, not 'none')"
                )
        if 2 * self.vae_tile_overlap > self.vae_tile:
            raise ValueError(f"vae_tile_overlap {self.vae_tile_overlap} is above half of vae_tile {self.vae_tile}")
        if bool(self.auth_username) != bool(self.auth_password):
            raise ValueError("auth needs both NEURON_APP_AUTH_USERNAME and NEURON_APP_AUTH_PASSWORD")
        if self.api_key is not None:
            if DEFAULT_KEY_NAME in self.api_keys:
                raise ValueError(
                    f"api_keys may not name a key {DEFAULT_KEY_NAME!r} while api_key is set: that is api_key's name"
                )
            if any(k.key.get_secret_value() == self.api_key.get_secret_value() for k in self.api_keys.values()):
                raise ValueError("api_key is also one of api_keys: give each caller one key")
        if self.tp_degree > 1 and self.placement not in ("auto", "together"):
            raise ValueError(
                f"placement={self.placement} with tp_degree={self.tp_degree} is not served: under torchrun each rank "
                "holds one NeuronCore (its shard, a text encoder and a VAE), so TP serves placement=together only"
            )
        if self.webhook_hosts:
            _check_webhook_secret(self.webhook_secret)
        return self

    def _apply_model_defaults(self) -> None:
        """A small shipped model serves its own shapes and prompt length where the settings keep the 4B's stock
        values (1024 px shapes and 512 tokens would be slow and far outside what it learned); set values stay."""
        for name, value in MODEL_DEFAULTS.get(self.model, {}).items():
            if getattr(self, name) == type(self).model_fields[name].default:
                setattr(self, name, value)
