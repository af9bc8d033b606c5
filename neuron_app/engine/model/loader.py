"""Model loading: one `from_pretrained` path for the Hub model, a local folder and the tiny model."""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_app.engine.model.placement import Placement, move, place_pipeline
from neuron_app.engine.model.real.random_weights import RANDOM_MODELS, ensure_random, remove_stale_staging
from neuron_app.engine.model.real.random_weights import VERSION as RANDOM_VERSION
from neuron_app.engine.model.real.random_weights import folder_name as random_folder
from neuron_app.engine.model.text_encoder import truncate_pipeline_encoder
from neuron_app.engine.model.tiny import RECIPE_VERSION, VARIANTS, ensure_tiny
from neuron_app.engine.modes.previews import read_factors
from neuron_app.errors import ModelLoadError, one_line
from neuron_app.settings import MODEL_DEFAULTS, Settings, shipped_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from, and a stable identity for the compile fingerprint."""

    location: str  # a Hub id or an absolute folder
    revision: str | None
    identity: str  # Hub id@revision, or a hash of a local folder's configs
    tiny: str | None = None  # the tiny variant to build into `location` on first load
    random: str | None = None  # the real-size random model (klein-4b-random...) to build there on first load

    @property
    def is_local(self) -> bool:
        return self.tiny is not None or self.random is not None or Path(self.location).is_dir()


def _config_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*.json")):
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def resolve_source(settings: Settings) -> ModelSource:
    """Turn the `model` setting into a source, cheaply: nothing is downloaded or built here."""
    if settings.model in VARIANTS:
        folder = settings.cache_dir / "models" / VARIANTS[settings.model].folder_name
        return ModelSource(str(folder), None, f"{settings.model}:v{RECIPE_VERSION}", tiny=settings.model)
    if settings.model in RANDOM_MODELS:  # the real architecture at its real size, random weights (real/)
        folder = settings.cache_dir / "models" / random_folder(settings.model)
        identity = f"{settings.model}:v{RANDOM_VERSION}"
        return ModelSource(str(folder), None, identity, random=settings.model)
    if settings.model in MODEL_DEFAULTS:
        folder = shipped_model(settings.model)
        if not (folder / "model_index.json").is_file():
            raise ModelLoadError(
                f"{settings.model} is not in this checkout (neuron_app/models/{settings.model}): "
                "train it with python -m neuron_app train-tiny"
            )
        return ModelSource(str(folder), None, f"{settings.model}:{_config_hash(folder)}")
    path = Path(settings.model).expanduser()
    looks_local = path.is_absolute() or settings.model.startswith(".") or path.exists()
    if looks_local:
        if not path.is_dir():
            raise ModelLoadError(
                f"model folder {path} does not exist (set NEURON_APP_MODEL to a Hub id, a pipeline folder, or 'tiny')"
            )
        if not (path / "model_index.json").is_file():
            raise ModelLoadError(
                f"model folder {path} has no model_index.json: it is not a saved diffusers pipeline "
                "(set NEURON_APP_MODEL to a Hub id, a pipeline folder, or 'tiny')"
            )
        try:
            json.loads((path / "model_index.json").read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"model folder {path}: model_index.json is unreadable ({exc})") from exc
        return ModelSource(str(path.resolve()), None, f"local:{_config_hash(path)}")
    if "/" not in settings.model:  # a Hub id is org/name; a bare word is a name of ours, mistyped
        known = [*VARIANTS, *RANDOM_MODELS, *MODEL_DEFAULTS]
        close = difflib.get_close_matches(settings.model, known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"the names here are {', '.join(known)}"
        raise ModelLoadError(
            f"model {settings.model!r} is no model of this app, no folder and no Hub id (org/name): {hint}"
        )
    return ModelSource(settings.model, settings.revision, f"{settings.model}@{settings.revision or 'main'}")


def load_pipeline(
    settings: Settings,
    source: ModelSource,
    device: str,
    dtype: Any,
    tp_mesh: Any = None,
    sharded_load: Callable[[Any], AbstractContextManager[None]] = lambda mesh: nullcontext(),
    placement: Placement | None = None,
    device_at: Callable[[int], str] | None = None,
    switch: Any = None,
) -> Any:
    """Load `Flux2KleinPipeline` and move it to `device`, or each component to its own (`placement`, `device_at`).

    With `tp_mesh` (tensor parallelism), the transformer is loaded sharded with `TensorParallelConfig(mesh=...)`
    inside the backend's `sharded_load`, and the other components are moved to this rank's device.
    """
    from diffusers import Flux2KleinPipeline

    if source.tiny:
        ensure_tiny(settings.cache_dir / "models", source.tiny)
    if source.random:
        ensure_random(settings.cache_dir / "models", source.random)
    else:  # a killed build's staging folders are removed at the next start, whatever it serves
        remove_stale_staging(settings.cache_dir / "models")
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    kwargs: dict[str, Any] = {"dtype": dtype, "revision": source.revision, "token": token}
    try:
        if tp_mesh is not None:
            with sharded_load(tp_mesh):
                kwargs["transformer"] = _load_sharded_transformer(source, dtype, tp_mesh, token)
        pipe = Flux2KleinPipeline.from_pretrained(source.location, **kwargs)
    except Exception as exc:
        raise ModelLoadError(_explain_load_error(source, exc)) from exc
    pipe.set_progress_bar_config(disable=True)
    # A model trained here brings its own latent-to-RGB map for the live previews (engine/modes/previews.py).
    pipe.preview_rgb = read_factors(Path(source.location)) if source.is_local else None
    truncate_pipeline_encoder(pipe)  # before the move: the cut layers never reach the device
    if tp_mesh is None and placement is not None and placement.name not in (None, "together") and device_at:
        move(pipe, placement, device_at, switch)  # each component straight to its core: never all on one first
    elif tp_mesh is None:
        pipe.to(device)
        if placement is not None and switch is not None and switch.current_device_index() is not None:
            place_pipeline(pipe, placement, switch)  # one core: the call still runs with it current
    else:
        for name in ("text_encoder", "vae"):
            getattr(pipe, name).to(device)
    return pipe


def _load_sharded_transformer(source: ModelSource, dtype: Any, mesh: Any, token: str | None) -> Any:
    from diffusers import Flux2Transformer2DModel, TensorParallelConfig

    return Flux2Transformer2DModel.from_pretrained(
        source.location,
        subfolder="transformer",
        dtype=dtype,
        revision=source.revision,
        token=token,
        parallel_config=TensorParallelConfig(mesh=mesh),
    )


def _explain_load_error(source: ModelSource, exc: Exception) -> str:
    if source.is_local:
        return f"could not load the pipeline from {source.location}: {one_line(exc)}"
    return (
        f"could not load {source.location!r} from the Hugging Face Hub ({one_line(exc)}). "
        "Without network access use NEURON_APP_SETTINGS=quickstart.toml (tiny-shapes: a small klein shipped here "
        "that draws coloured shapes) or a local folder holding the downloaded pipeline"
    )
