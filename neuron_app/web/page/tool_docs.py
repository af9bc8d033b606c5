"""The named API endpoints' descriptions, built from the settings: Gradio makes the MCP tools from them (the
description, then Args one line each, then Returns), so they name the shapes, limits and styles served."""

from __future__ import annotations

from neuron_app.engine.requests import MAX_SEED
from neuron_app.settings import Settings

STATUS_DOC = (
    "The server's state: model, device, whether the model is loaded, and per shape its state"
    " (ready, compiling, not_compiled, failed), hits and compile seconds.\n\nReturns:\n    The status as JSON."
)


def _style_lines(settings: Settings) -> list[str]:
    """The optional LoRA arguments, alike for every endpoint."""
    return [
        f"    lora: The LoRA style, one of {', '.join(['none', *settings.loras])} (optional, default none).",
        f"    lora_scale: The style's strength, from 0 to {settings.max_lora_scale:g} (optional, default 1).",
        f"    loras: Several styles at once, instead of lora (optional): a list of up to"
        f' {settings.max_loras_per_request} {{"name": ..., "scale": ...}}, names as for lora, scales from 0 to'
        f" {settings.max_lora_scale:g}.",
    ]


def generate_doc(settings: Settings) -> str:
    shapes = ", ".join(settings.resolutions)
    return "\n".join(
        [
            "Generate one image with FLUX.2-klein from a text prompt; the same inputs give the same image.",
            "",
            "Args:",
            f"    prompt: What the image shows, at most {settings.max_prompt_chars} characters.",
            f"    resolution: WIDTHxHEIGHT, one of {shapes}. The status tool says which are offered and compiled;"
            " another shape compiles on first use (minutes on Neuron).",
            f"    steps: Denoising steps, a whole number from 1 to {settings.max_steps}"
            f" ({settings.default_steps} suits the step-distilled klein).",
            f"    seed: A whole number from 0 to {MAX_SEED}; the same seed gives the same image.",
            *_style_lines(settings),
            "",
            "Returns:",
            "    The PNG image, and a JSON record: resolution, steps, seed, cache (miss, memory or disk), seconds.",
        ]
    )


def edit_doc(settings: Settings) -> str:
    shapes = ", ".join(settings.resolutions)
    return "\n".join(
        [
            "Edit with FLUX.2-klein: a new image from a prompt and 1 to"
            f" {settings.max_references} reference images; the same inputs give the same image.",
            "",
            "Args:",
            "    prompt: What to change or make from the references.",
            f"    images: The reference image files (up to {settings.max_references}); each is resized and"
            " center-cropped to the nearest served aspect ratio.",
            f"    resolution: WIDTHxHEIGHT, one of {shapes}, or auto: the shape nearest the first reference's"
            " aspect ratio.",
            f"    steps: Denoising steps, a whole number from 1 to {settings.max_steps}.",
            f"    seed: A whole number from 0 to {MAX_SEED}.",
            *_style_lines(settings),
            "",
            "Returns:",
            "    The PNG image, and a JSON record as generate's plus references: each one's size and bucket.",
        ]
    )


def inpaint_doc(settings: Settings) -> str:
    """The `inpaint` endpoint's description (Gradio makes the MCP tool from it: one line per argument)."""
    shapes = ", ".join(settings.resolutions)
    return "\n".join(
        [
            "Inpaint with FLUX.2-klein: redraw the masked part of an image from a prompt; the rest keeps the image's"
            " pixels. The same inputs give the same image.",
            "",
            "Args:",
            "    prompt: What the masked part should show.",
            "    image: The image file to change; it is resized and center-cropped to the resolution.",
            "    mask: A PNG the image's size: fully transparent pixels mark what to redraw (OpenAI's rule); a mask"
            " without transparency marks it in white.",
            f"    resolution: WIDTHxHEIGHT, one of {shapes}, or auto: the shape nearest the image's aspect ratio.",
            f"    steps: Denoising steps, a whole number from 1 to {settings.max_steps}.",
            f"    seed: A whole number from 0 to {MAX_SEED}.",
            *_style_lines(settings),
            "    strength: How much of the masked part is redrawn, more than 0 and at most 1 (optional, default 1).",
            "",
            "Returns:",
            "    The PNG image, and a JSON record as generate's.",
        ]
    )
