"""What a caller may ask, and the one validation every entry shares.

The page, gradio_client, the OpenAI-compatible API, MCP, the command line and replicas all go
through `validate`: a refusal reads the same everywhere and costs no model work.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from neuron_app.engine.model.runner import PipelineCall
from neuron_app.engine.modes import masks
from neuron_app.engine.modes import references as refs
from neuron_app.engine.modes.edit_graphs import parse_label
from neuron_app.engine.modes.img2img import kept_steps
from neuron_app.engine.trust.blocked_terms import check_blocked
from neuron_app.errors import RequestError
from neuron_app.settings import Settings
from neuron_app.shapes import Resolution

MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class Request:
    prompt: str
    resolution: Resolution
    steps: int
    seed: int
    loras: tuple[tuple[str, float], ...] = ()  # the styles and their scales, in configured order (check_loras)
    references: tuple[refs.Reference, ...] = ()  # an edit: normalized to their buckets
    source: masks.InpaintSource | None = None  # image-to-image, or inpaint with its mask (engine/modes/img2img.py)
    strength: float = 1.0
    previews: bool = False  # the page's live previews (engine/modes/previews.py)
    output: tuple[str, int | None] | None = None  # the file's format and quality (OpenAI's); None: PNG

    @property
    def lora(self) -> str:
        """The first style (or `none`): what single-style readers show."""
        return self.loras[0][0] if self.loras else "none"

    @property
    def lora_scale(self) -> float:
        return self.loras[0][1] if self.loras else 1.0

    @property
    def buckets(self) -> tuple[Resolution, ...]:
        return tuple(r.bucket for r in self.references)

    def portable(self) -> dict[str, Any]:
        """The request as `validate`'s keyword arguments, for another process (a replica) that re-validates it:
        references as their uploads' bytes (or PIL images), never a local path."""
        return {
            "prompt": self.prompt,
            "resolution": str(self.resolution),
            "steps": self.steps,
            "seed": self.seed,
            "loras": [{"name": name, "scale": scale} for name, scale in self.loras] or None,
            "references": [r.upload for r in self.references] if self.references else None,
            **(self._portable_source() if self.source else {}),
        }

    def _portable_source(self) -> dict[str, Any]:
        assert self.source is not None
        return {"image": self.source.upload, "mask": self.source.mask_upload, "strength": self.strength}

    def call(self) -> PipelineCall:
        """The pipeline call this request makes (what tensor-parallel followers replay)."""
        res, images = self.resolution, tuple(r.image for r in self.references)
        return PipelineCall(
            self.prompt,
            res.width,
            res.height,
            self.steps,
            self.seed,
            loras=self.loras,
            references=images,
            init_image=None if self.source is None else self.source.image,
            mask=None if self.source is None else self.source.mask,
            strength=self.strength,
            previews=self.previews,
        )


def validate(
    settings: Settings,
    offered: list[str],
    prompt: Any,
    resolution: Any,
    steps: Any,
    seed: Any,
    *,
    lora: Any = "none",
    lora_scale: Any = 1.0,
    loras: Any = None,
    references: Sequence[Any] | None = None,
    image: Any = None,
    mask: Any = None,
    strength: Any = None,
    previews: Any = False,
) -> Request:
    """Check a request against what the UI offers (`offered` shapes); raises `RequestError` with a clear message.

    `references` None is text-to-image; a sequence is an edit (see `engine/modes/references.py`), where `resolution`
    may be "auto": the offered shape nearest in aspect ratio to the first reference. `image` starts from that
    image (image-to-image at `strength`, 0 < strength <= 1, default 1); with `mask` only the masked part is
    redrawn (engine/modes/masks.py); "auto" then follows the image. `previews` True: a preview per step (the page).
    `loras` (a list of {"name", "scale"}) combines styles; the single `lora`/`lora_scale` is a list of one."""
    prompt = check_prompt(prompt, settings.max_prompt_chars)
    check_blocked(prompt, settings.blocked_terms, settings.blocked_terms_file)  # ContentRefused, before any work
    auto = resolution == "auto"
    if mask is not None and image is None:
        raise RequestError("a mask needs the image it masks (image)", param="mask")
    if auto and references is None and image is None:
        raise RequestError(
            "resolution 'auto' needs reference images (it follows the first one's aspect ratio)", param="resolution"
        )
    res = None if auto else check_resolution(resolution, offered)
    steps = check_int("steps", steps, 1, settings.max_steps)
    seed = check_int("seed", seed, 0, MAX_SEED)
    styles = check_loras(settings, lora, lora_scale, loras)
    strength = check_strength(strength, steps, image is not None)
    loaded = refs.check_references(settings, references)  # last: no image is decoded for a bad request
    source = None
    if image is not None:
        shapes = [Resolution.parse(name) for name in offered]
        source = masks.load_source(settings, image, mask, lambda w, h: res or refs.nearest(w, h, shapes))
        res = res or Resolution(source.image.width, source.image.height)
    res = res or refs.auto_resolution(loaded[0], offered)
    options = {"loras": styles, "references": loaded, "source": source, "strength": strength}
    return Request(prompt, res, steps, seed, previews=previews is True, **options)


def check_strength(strength: Any, steps: int, has_image: bool) -> float:
    """0 < strength <= 1 (at least one of `steps` then runs: diffusers rounds the skipped steps down); only
    with an image."""
    if strength is None:
        return 1.0
    if not has_image:
        raise RequestError("strength needs an image to start from (image)", param="strength")
    value = check_float("strength", strength, 0.0, 1.0)
    if value <= 0.0 or kept_steps(steps, value) < 1:
        message = f"strength {value:g} runs no step: it must be more than 0 (1 = start from noise)"
        raise RequestError(message, param="strength")
    return value


def check_lora(lora: Any, offered: list[str], param: str = "lora") -> str:
    """A configured style name (or `none`); an unknown one is refused with the list of styles."""
    if lora is None:
        return "none"
    if not isinstance(lora, str) or lora.strip() not in offered:
        shown = repr(lora) if isinstance(lora, str) and len(lora) <= 80 else f"a {type(lora).__name__}"
        raise RequestError(f"LoRA style {shown} is not offered; choose one of {', '.join(offered)}", param=param)
    return lora.strip()


def check_loras(settings: Settings, lora: Any, lora_scale: Any, loras: Any) -> tuple[tuple[str, float], ...]:
    """The styles of a request, as (name, scale) in configured order (slots add, so the order asked for does not
    change the image; one order makes it the same bits). `loras`: [{"name", "scale"}, ...] (scale optional,
    default 1; a JSON text of that list is read too; `none` entries are skipped); without it, `lora` and
    `lora_scale` are a list of one. Unknown names, duplicates, too many and scales out of range are refused."""
    offered = ["none", *settings.loras]
    single = check_lora(lora, offered)
    if isinstance(loras, str) and loras.strip():
        try:
            loras = json.loads(loras)
        except (ValueError, RecursionError):  # 5,000 nested brackets: Python's parser gives up (issue 52 row 48)
            raise RequestError('loras must be a JSON list of {"name": ..., "scale": ...}', param="loras") from None
    if loras is None or loras == "" or loras == []:
        scale = check_float("lora_scale", 1.0 if lora_scale is None else lora_scale, 0.0, settings.max_lora_scale)
        return () if single == "none" else ((single, scale),)
    if single != "none":
        raise RequestError("give either lora (one style) or loras (a list), not both", param="loras")
    if not isinstance(loras, (list, tuple)):
        raise RequestError(f"loras must be a list of {{name, scale}}, got {type(loras).__name__}", param="loras")
    chosen: dict[str, float] = {}
    for item in loras:
        name, scale = (item, 1.0) if isinstance(item, str) else (None, None)
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"name", "scale"})
            if unknown:
                raise RequestError(f"loras entries take name and scale, not {unknown[0]!r}", param="loras")
            name, scale = item.get("name"), item.get("scale", 1.0)
        if name is None:
            raise RequestError('each loras entry is {"name": ..., "scale": ...} (or a name)', param="loras")
        name = check_lora(name, offered, param="loras")
        scale = check_float("loras", 1.0 if scale is None else scale, 0.0, settings.max_lora_scale)
        if name in chosen:
            raise RequestError(f"LoRA style {name!r} is listed twice in loras", param="loras")
        if name != "none":
            chosen[name] = scale
    most = min(settings.max_loras_per_request, len(settings.loras))
    if len(chosen) > most:
        raise RequestError(f"loras lists {len(chosen)} styles; this server combines at most {most}", param="loras")
    return tuple((name, chosen[name]) for name in settings.loras if name in chosen)


def check_float(name: str, value: Any, low: float, high: float) -> float:
    """A finite number in [low, high] (JSON clients may send integers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        message = f"{name} must be a number between {low:g} and {high:g}, got {type(value).__name__}"
        raise RequestError(message, param=name)
    value = float(value)
    if not math.isfinite(value) or not low <= value <= high:
        raise RequestError(f"{name} must be between {low:g} and {high:g}, got {value:g}", param=name)
    return value


def check_prompt(prompt: Any, max_chars: int) -> str:
    if not isinstance(prompt, str):
        raise RequestError("prompt must be text", param="prompt")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("prompt contains invalid characters (unpaired surrogates)", param="prompt") from None
    # Control characters (other than newline and tab) are replaced by spaces.
    cleaned = "".join(" " if unicodedata.category(ch) == "Cc" and ch not in "\n\t" else ch for ch in prompt).strip()
    if not cleaned:
        raise RequestError("prompt is empty: describe the image you want", param="prompt")
    if len(cleaned) > max_chars:
        raise RequestError(f"prompt is {len(cleaned)} characters long; the limit is {max_chars}", param="prompt")
    return cleaned


def parse_resolution(resolution: Any, param: str = "resolution") -> Resolution:
    """A strict "WIDTHxHEIGHT"; a `ShapeError` (a `RequestError`) names `param`."""
    try:
        return Resolution.parse(resolution)
    except RequestError as exc:
        exc.param = param
        raise


#: Said after every size refusal, on every entry: the page, gradio_client, MCP and the OpenAI API.
SIZE_POLICY_HINT = 'size_policy = "nearest" (NEURON_APP_SIZE_POLICY=nearest) lets the OpenAI API take any size'


def size_refusal(reason: str, offered: Sequence[str]) -> str:
    """Why a size is refused, what is offered instead, and the setting that takes any size."""
    return f"{reason}; choose one of {', '.join(offered)} ({SIZE_POLICY_HINT})"


def check_resolution(resolution: Any, offered: list[str]) -> Resolution:
    """An offered shape; a malformed one is refused with the offered list too (a caller typed it)."""
    try:
        res = parse_resolution(resolution)
    except RequestError as exc:
        raise RequestError(size_refusal(str(exc), offered), param="resolution") from None
    if str(res) not in offered:
        raise RequestError(size_refusal(f"resolution {res} is not offered", offered), param="resolution")
    return res


def check_bucket(settings: Settings, bucket: Any) -> Resolution:
    """A reference bucket named by precompile or warm-up: one of `reference_resolutions`."""
    allowed = settings.parsed_reference_resolutions
    if not allowed:
        raise RequestError(
            "no reference bucket fits (at least 64 px a side, at most 1024x1024): set reference_resolutions",
            param="references",
        )
    res = bucket if isinstance(bucket, Resolution) else parse_resolution(bucket, "references")
    if res not in allowed:
        configured = ", ".join(map(str, allowed))
        raise RequestError(f"reference bucket {res} is not configured; configured: {configured}", param="references")
    return res


def edit_target(manager: Any, resolution: Any, references: Sequence[Any]) -> tuple[Resolution, tuple[Resolution, ...]]:
    """What `compile_shape` was asked for: a configured shape and checked reference buckets (an edit label names
    both)."""
    res, buckets = (isinstance(resolution, str) and parse_label(resolution)) or (resolution, references)
    res = res if isinstance(res, Resolution) else manager.configured_resolution(res)
    return res, tuple(check_bucket(manager.settings, b) for b in buckets)


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """Integers only (an integral float such as 4.0 is accepted: JSON clients send those)."""
    if value is None:  # a client that pads missing inputs with None (@gradio/client's positional predict)
        raise RequestError(f"{name} must be a whole number between {low} and {high}; it is missing (null)", param=name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        message = f"{name} must be a whole number between {low} and {high}, got {type(value).__name__}"
        raise RequestError(message, param=name)
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise RequestError(f"{name} must be a whole number between {low} and {high}, got {value}", param=name)
        value = int(value)
    if not low <= value <= high:
        raise RequestError(f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


# --- several images per request, and OpenAI's size names ------------------------------------------
AUTO_SIZE = "auto"


def check_images(n: Any, max_images: int) -> int:
    """How many images one request makes (one after another, seeds seed, seed+1, ...)."""
    return check_int("n", n, 1, max_images)


def check_seed_run(seed: Any, n: int) -> int:
    """The first of `n` consecutive seeds: every one of them must be a valid seed."""
    return check_int("seed", seed, 0, MAX_SEED - (n - 1))


def resolve_size(size: Any, default: str, offered: list[str]) -> Any:
    """OpenAI's `size`: absent or "auto" means the default shape (or the first offered); others pass as given."""
    if size is None or size == AUTO_SIZE:
        return default if default in offered or not offered else offered[0]
    return size
