"""Application settings: `settings.toml` defaults, overridden by `NEURON_APP_*` variables.

Priority (highest first): arguments passed in code, environment, the TOML file.
Secrets (auth password, Hub token) come from the environment only and are `SecretStr`.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings import SettingsError as PydanticSettingsError

from neuron_app.errors import SettingsError, ShapeError, one_line
from neuron_app.settings_groups import (  # noqa: F401 (re-exported: callers import them from here)
    DEFAULT_KEY_NAME,
    MAX_REFERENCE_AREA,
    MIN_KEY_CHARS,
    MIN_REFERENCE_SIDE,
    ApiKey,
    EditingSettings,
    FleetSettings,
    InterfaceSettings,
    LoraSettings,
    ReplicaRange,
    ServerSettings,
    _check_webhook_secret,
    parse_s3_url,
)
from neuron_app.settings_sources import FriendlyEnvSource, check_settings_file, did_you_mean
from neuron_app.settings_stored import StoredStateSettings
from neuron_app.shapes import Resolution

PROJECT_ROOT = Path(__file__).resolve().parent.parent
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
TINY = "tiny"
#: Models trained here that ship in the repository (neuron_app/models/NAME, docs/tiny-shapes.md).
SHIPPED_MODELS = Path(__file__).resolve().parent / "models"


def shipped_model(name: str) -> Path:
    return SHIPPED_MODELS / name


#: What a shipped model serves when the settings leave these at their defaults (the 4B's).
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny-shapes": {
        "resolutions": ["128x128", "256x256", "256x128", "128x256"],
        "default_resolution": "128x128",
        "max_sequence_length": 32,
        "example_prompts": [
            "a purple circle on a yellow background",
            "a red square on a blue background on the left",
            "a large green triangle on a white background",
            "a small yellow circle on a black background at the top",
        ],
    }
}
#: The pipeline downsizes references above this area and refuses sides under 64 px (diffusers 0.42.1).


def settings_file() -> Path:
    """The TOML file in force: `$NEURON_APP_SETTINGS`, else `settings.toml` at the project root."""
    override = os.environ.get(SETTINGS_FILE_ENV)
    if not override:
        return PROJECT_ROOT / "settings.toml"
    return check_settings_file(Path(override).expanduser().resolve(), SETTINGS_FILE_ENV)


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "neuron-app"


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


class Settings(
    InterfaceSettings, StoredStateSettings, FleetSettings, EditingSettings, LoraSettings, ServerSettings, BaseSettings
):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
    )

    # --- model -------------------------------------------------------------------------
    model: str = Field(
        "black-forest-labs/FLUX.2-klein-4B",
        description="Hub id or local folder of a Flux2KleinPipeline; 'tiny-shapes' for the small model trained on "
        "coloured shapes that ships here (docs/tiny-shapes.md); 'tiny' for the offline random test model.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of `model`.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weights dtype; auto = bfloat16 on neuron/cuda, float32 on cpu."
    )
    hf_token: SecretStr | None = Field(
        None, description="Hub token for gated models (environment only: NEURON_APP_HF_TOKEN)."
    )

    # --- device and compilation ----------------------------------------------------------
    device: Literal["auto", "neuron", "neuron-emulated", "cuda", "cpu"] = Field(
        "auto",
        description="Where to run; auto picks neuron, then cuda, then cpu. neuron-emulated runs the neuron code "
        "path on CPU under TorchNeuron's rules (tests, CI, the selftest without Trainium).",
    )
    neuron_rules: Literal["enforce", "record"] = Field(
        "enforce",
        description="neuron-emulated: a request that breaks a TorchNeuron rule fails (enforce) or is only "
        "counted in status (record).",
    )
    vae_device: Literal["device", "cpu"] = Field(
        "device",
        description="Where the VAE decodes: on the device (tiled when vae_compile is on), or on the host CPU in "
        "float32 (no VAE graph to compile; what a public klein-4B Trainium port does).",
    )
    compile_mode: Literal["eager", "full", "regional"] = Field(
        "full",
        description="eager: no torch.compile; full: the whole transformer, fullgraph, static shapes; "
        "regional: compile_repeated_blocks (one graph per block class, shorter compile).",
    )
    compile_backend: str | None = Field(
        None,
        description="torch.compile backend; default neuron on neuron, inductor on cuda/cpu. "
        "aot_eager compiles in seconds and is used by the tests.",
    )
    vae_compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Decode in fixed-size compiled VAE tiles (one VAE graph for every shape; shapes with the "
        "same token count then share everything): auto = on for neuron, off elsewhere.",
    )
    vae_tile: int = Field(
        32,
        ge=8,
        le=256,
        description="VAE tile side in latent pixels (x8 image pixels: 256 px); one compiled graph. Small on purpose: "
        "a whole 1024 px decode was measured past neuronx-cc's instruction limit, a 512 px tile reported not to "
        "compile in 30 min (docs/compiling-less.md).",
    )
    vae_tile_overlap: int = Field(
        8, ge=0, le=128, description="Latent pixels shared by neighbouring VAE tiles, blended across (<= tile/2)."
    )
    prompt_cache_size: int = Field(
        64, ge=0, description="Encoded prompts kept (LRU) so repeated prompts skip the text encoder; 0 = off."
    )
    previews: bool = Field(
        True, description="The page shows a host-side preview of the latents after each step (no VAE, no compile)."
    )
    tp_degree: int = Field(
        1, ge=1, description="Tensor-parallel degree (NeuronCores per model); set by torchrun's WORLD_SIZE."
    )
    visible_cores: str | None = Field(
        None,
        description="NeuronCores this process reserves: N, N-M or a list covering one contiguous range (3-5,6), "
        "exported as NEURON_RT_VISIBLE_CORES; unset = every core it can see. Not under torchrun, which gives "
        "each rank one core.",
    )

    # --- requests --------------------------------------------------------------------------
    resolutions: list[str] = Field(
        ["1024x1024", "1152x1024", "1024x1152", "1536x768", "768x1536", "1024x896", "896x1024"],
        description="The only shapes served, as WIDTHxHEIGHT, multiples of 16 (each is a compile on Neuron). The "
        "defaults' image tokens are multiples of 512, so with 512 text tokens every one takes Neuron's NKI "
        "attention kernel.",
    )
    default_resolution: str = Field("1024x1024", description="Shape preselected in the UI; must be listed.")
    default_steps: int = Field(4, ge=1, description="Steps preselected in the UI (klein is step-distilled: 4).")
    max_steps: int = Field(16, ge=1, le=200, description="Largest step count a request may ask for.")
    max_sequence_length: int = Field(
        512, ge=8, le=2048, description="Prompt tokens; prompts are padded to it, changing it recompiles."
    )
    guidance_scale: float = Field(
        1.0, ge=0.0, le=30.0, description="Guidance scale; ignored by the distilled klein models."
    )
    max_prompt_chars: int = Field(2000, ge=1, description="Longer prompts are refused before any model work.")
    example_prompts: list[str] = Field(
        [
            "A lighthouse on a cliff at dawn, volumetric light, 35mm photo",
            "A watercolor fox reading a book under a cherry tree",
            "Isometric cutaway of a tiny robot workshop, soft pastel colors",
        ],
        description="Prompts the page offers as examples (tiny-shapes offers prompts of its grammar).",
    )

    # --- cache and start-up ----------------------------------------------------------------
    cache_dir: Path = Field(
        default_factory=_default_cache_dir,
        description="Persistent folder for compiled artifacts (NEFF / inductor), the manifest, "
        "the tiny model and outputs. Never /tmp: it is wiped on reboot.",
    )
    load_on_start: bool = Field(False, description="Load the pipeline at start instead of on the first request.")
    warmup: Literal["none", "precompiled", "all"] = Field(
        "none", description="Compile shapes in the background at start: none, those in the manifest, or all."
    )
    only_precompiled: bool = Field(
        False, description="Offer only shapes that are precompiled or compiled in this process."
    )
    cache_remote: str | None = Field(
        None,
        description="s3://bucket/prefix holding compiled artifacts for many instances: `cache push` uploads, "
        "the app pulls its fingerprint's at start and before compiling (boto3, standard AWS credentials, "
        "AWS_ENDPOINT_URL for S3-compatible stores); unset: off.",
    )
    cache_remote_timeout_s: float = Field(
        10.0, gt=0.0, le=600.0, description="Connect and read timeout of each S3 call; a slow store is skipped."
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

    @field_validator("resolutions")
    @classmethod
    def _check_resolutions(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one resolution is needed")
        for text in value:
            try:
                Resolution.parse(text)
            except ShapeError as exc:
                raise ValueError(str(exc)) from None
        if len(set(value)) != len(value):
            raise ValueError("resolutions are listed more than once")
        return value

    @field_validator("visible_cores")
    @classmethod
    def _check_visible_cores(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from neuron_app.environment import parse_cores

        first, last = parse_cores(value)  # the runtime's list forms too; written back as one range
        return str(first) if first == last else f"{first}-{last}"

    @field_validator("webhook_hosts")
    @classmethod
    def _check_webhook_hosts(cls, value: list[str]) -> list[str]:
        """Host names, IP addresses or networks; a URL or a host:port would silently match nothing."""
        import ipaddress

        for entry in value:
            text = entry.strip().lower().rstrip(".").strip("[]")
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError:
                if not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", text):
                    raise ValueError(
                        f"webhook_hosts entry {entry!r} is not a host name, an IP address or a network "
                        "(no scheme, port or path: 'hooks.example.com', '10.0.0.5', '10.0.0.0/8')"
                    ) from None
        return value

    @field_validator("cache_dir")
    @classmethod
    def _check_cache_dir(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @field_validator("cache_remote")
    @classmethod
    def _check_cache_remote(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        bucket, prefix = parse_s3_url(value)
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

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
        if self.replicas > 1 and self.tp_degree > 1:
            raise ValueError(
                f"replicas={self.replicas} with tp_degree={self.tp_degree} is not supported: replicas are data "
                "parallel with one model copy each; use torchrun for tensor parallelism, or set replicas=1"
            )
        if self.webhook_hosts:
            _check_webhook_secret(self.webhook_secret)
        return self

    # --- derived -----------------------------------------------------------------------------
    @property
    def parsed_resolutions(self) -> list[Resolution]:
        return [Resolution.parse(r) for r in self.resolutions]

    @property
    def device_lanes(self) -> int:
        """Device events the queue runs at once: one per replica (each replica takes one request at a time);
        with replicas = "MIN-MAX", one per replica at the most."""
        return max(self.concurrency_limit, self.replicas_max)

    @property
    def replicas_min(self) -> int:
        """Fewest replicas: MIN of "MIN-MAX", else `replicas`."""
        return getattr(self.replicas, "min", int(self.replicas))

    @property
    def replicas_max(self) -> int:
        """Most replicas: MAX of "MIN-MAX", else `replicas` (the int value of `replicas` either way)."""
        return int(self.replicas)

    @property
    def autoscaling(self) -> bool:
        """replicas = "MIN-MAX" with MIN < MAX: Ray Serve adds and removes replicas with the queue."""
        return self.replicas_min < self.replicas_max

    @property
    def outputs_dir(self) -> Path:
        """Generated images (the page's, the API's, the OpenAI API's `url` answers): served from where they lie."""
        return self.cache_dir / "outputs"

    @property
    def uses_replicas(self) -> bool:
        """Serve through Ray Serve replicas instead of an in-process manager."""
        return self.replicas > 1 or bool(self.ray_address)

    @property
    def parsed_reference_resolutions(self) -> list[Resolution]:
        """The reference buckets: the configured ones, else the served shapes the pipeline leaves unchanged."""
        if self.reference_resolutions:
            return [Resolution.parse(r) for r in self.reference_resolutions]
        return [
            r
            for r in self.parsed_resolutions
            if r.width * r.height <= MAX_REFERENCE_AREA and min(r.width, r.height) >= MIN_REFERENCE_SIDE
        ]

    @property
    def reachable_by_others(self) -> bool:
        """A public link, or bound to an address other machines can reach (not loopback)."""
        import ipaddress

        if self.share:
            return True
        name = self.server_name.strip().strip("[]")
        if name == "localhost":
            return False
        try:
            return not ipaddress.ip_address(name).is_loopback
        except ValueError:
            return True  # a host name other than localhost: assume the network can reach it

    @property
    def safety_on(self) -> bool:
        """The safety checker in force: on, off, or auto = on when others can reach the app."""
        return self.safety_checker == "on" or (self.safety_checker == "auto" and self.reachable_by_others)

    def _apply_model_defaults(self) -> None:
        """A small shipped model serves its own shapes and prompt length where the settings keep the 4B's stock
        values (1024 px shapes and 512 tokens would be slow and far outside what it learned); set values stay."""
        for name, value in MODEL_DEFAULTS.get(self.model, {}).items():
            if getattr(self, name) == type(self).model_fields[name].default:
                setattr(self, name, value)

    @property
    def is_tiny(self) -> bool:
        return self.model == TINY

    @property
    def auth(self) -> tuple[str, str] | None:
        if self.auth_username and self.auth_password:
            return (self.auth_username, self.auth_password.get_secret_value())
        return None


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
        raise SettingsError("; ".join(lines) + " (strict_env = true refuses unknown NEURON_APP_* variables)")
    for line in lines:
        logging.getLogger(__name__).warning("%s", line)


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
    except PydanticSettingsError as exc:  # a source that could not read a value: its reason, on one line
        cause = f": {one_line(exc.__cause__)}" if exc.__cause__ else ""
        raise SettingsError(f"invalid settings - {exc}{cause}") from None
    _check_env_names(settings.strict_env)
    return settings


@functools.cache
def get_settings() -> Settings:
    """The process-wide settings; tests call `get_settings.cache_clear()` after changing the environment."""
    return load_settings()
