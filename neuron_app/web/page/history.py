"""The page's history: this browser session's last images with how they were made (prompt, shape, steps, seed,
LoRA, cache result), to look back at and reuse. A click puts its settings back into the form; "Use as
reference" from it feeds an edit. Held per session (Gradio's session state): nothing is shared between users,
and no path a browser sends is trusted, since the entries never leave the server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gradio as gr

#: The most images the history keeps (the oldest drop out).
#: Gradio's gallery lays out as many columns as it has images: one image alone spanned the row, a square as wide as
#: the page cropped to a band. The history keeps its six columns from the first image on (given to launch()).
CSS = "#history .grid-container { grid-template-columns: repeat(6, minmax(100px, 1fr)) !important; }"
KEEP = 50


def entry(record: Any, path: str) -> dict[str, Any]:
    """What the history keeps of one generated image."""
    return {
        "image": path,
        "prompt": record.prompt,
        "resolution": record.resolution,
        "steps": record.steps,
        "seed": record.seed,
        "lora": record.lora,
        "lora_scale": record.lora_scale,
        "cache": str(record.cache),
    }


def caption(item: dict[str, Any]) -> str:
    lora = f" · LoRA {item['lora']} x{item['lora_scale']:g}" if item["lora"] != "none" else ""
    prompt = item["prompt"] if len(item["prompt"]) <= 60 else item["prompt"][:57] + "..."
    return f"{prompt} · {item['resolution']}, {item['steps']} steps, seed {item['seed']}{lora} · cache {item['cache']}"


def add(history: list[dict[str, Any]] | None, new: Sequence[dict[str, Any]] | None) -> tuple[Any, Any]:
    """The newest first, at most KEEP; returns the state and the gallery's value."""
    items = [*(new or []), *(history or [])][:KEEP]
    return items, [(item["image"], caption(item)) for item in items]


def reuse(history: list[dict[str, Any]] | None, evt: gr.SelectData) -> tuple[Any, ...]:
    """A click on an image: its settings back into the form (seed fixed: randomize off), and it is the selection
    "Use as reference" takes."""
    item = (history or [])[evt.index]
    return (
        item["prompt"],
        item["resolution"],
        item["steps"],
        item["seed"],
        False,
        item["lora"],
        item["lora_scale"],
        item["image"],
    )


def panel(editing: bool) -> tuple[Any, Any, Any, Any]:
    """The history's components (inside the Blocks): its state, gallery, the selected image and its button."""
    state = gr.State([])
    with gr.Accordion("History (this session)", open=True):
        gallery = gr.Gallery(
            label=f"Your last {KEEP} images: click one to reuse its settings",
            columns=6,
            height=220,
            object_fit="contain",
            allow_preview=False,
            interactive=False,
            elem_id="history",
        )
        selected = gr.State(None)
        use = gr.Button(
            "Use the selected one as reference", size="sm", visible=editing, elem_id="history-use-as-reference"
        )
    return state, gallery, selected, use


def wire(
    generated: Any, parts: tuple[Any, Any, Any, Any], last: Any, form: list[Any], references: Any, limit: int
) -> Any:
    """The history's events: each generation adds its images (`last`, set by the page's Generate), a click puts
    an image's settings into `form` (prompt, resolution, steps, seed, randomize, lora, lora_scale), and the
    button adds the selected image to `references` (returned: the page relabels its shapes after it). Private:
    none of them is an API endpoint."""
    from neuron_app.web.page.edit_controls import add_reference

    state, gallery, selected, use = parts
    quiet: dict[str, Any] = {"queue": False, "api_visibility": "private", "show_progress": "hidden"}
    generated.success(add, inputs=[state, last], outputs=[state, gallery], **quiet)
    gallery.select(reuse, inputs=[state], outputs=[*form, selected], **quiet)
    return use.click(
        lambda refs, image: add_reference(refs, image, limit), [references, selected], [references], **quiet
    )
