"""The page's extra LoRA styles: one more (style, scale) pair per slot beyond the first, so a page request can
combine up to `max_loras_per_request` styles like the APIs' `loras` (engine/modes/lora.py fills one slot each)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from neuron_app.settings import Settings


def extra_pairs(settings: Settings) -> list[Any]:
    """The (style, scale) components beyond the page's first pair, flat; none with one slot or no adapters."""
    count = min(settings.max_loras_per_request, len(settings.loras)) - 1
    components: list[Any] = []
    for position in range(2, count + 2):
        with gr.Row():
            components.append(
                gr.Dropdown(
                    label=f"Style {position} (LoRA)",
                    choices=["none", *settings.loras],
                    value="none",
                    elem_id=f"lora-{position}",
                )
            )
            components.append(
                gr.Slider(
                    label=f"LoRA {position} scale",
                    minimum=0.0,
                    maximum=settings.max_lora_scale,
                    step=0.05,
                    value=1.0,
                    elem_id=f"lora-{position}-scale",
                )
            )
    return components


def page_styles(lora: Any, lora_scale: Any, more: list[Any] | None) -> dict[str, Any]:
    """The page's pairs as the manager's arguments: the single form while only the first is used, else `loras`
    (the engine's one validation refuses duplicates and scales out of range)."""
    pairs = list(zip(more[::2], more[1::2], strict=True)) if more else []
    chosen = [(name, scale) for name, scale in pairs if name not in (None, "none")]
    if not chosen:
        return {"lora": lora, "lora_scale": lora_scale}
    first = [(lora, lora_scale)] if lora not in (None, "none") else []
    return {"loras": [{"name": name, "scale": scale} for name, scale in first + chosen]}


def with_extra_pairs(fn: Callable[..., Iterator[Any]], count: int) -> Callable[..., Iterator[Any]]:
    """`fn`'s page event taking `count` more inputs just before its `request` parameter, passed to `fn` as
    `more_styles` (Gradio reads the signature to place the request and progress, so the wrapper declares them)."""
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    split = next(i for i, p in enumerate(params) if p.name == "request")
    extra = [
        inspect.Parameter(f"more_{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for i in range(count)
    ]

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Iterator[Any]:
        own, more, rest = args[:split], args[split : split + count], args[split + count :]
        yield from fn(*own, *rest, more_styles=list(more))

    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*params[:split], *extra, *(p for p in params[split:] if p.name != "more_styles")]
    )
    return wrapper
