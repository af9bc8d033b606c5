"""What the page's inputs say about themselves, so nothing is cut or clamped without a word: the prompt box's
counter (a text over the limit is not cut, as the browser's `maxlength` did silently, but named, and refused as
the API refuses it), the steps slider's range and what it does above it, what more steps do to the model, and
what a live preview is."""

from __future__ import annotations

from typing import Any


def prompt_info(length: int, limit: int) -> str:
    """The counter under the prompt box; over the limit, by how much and what Generate does with it."""
    if length <= limit:
        return f"{length} / {limit} characters"
    return f"{length} / {limit} characters: {length - limit} over max_prompt_chars, not cut: Generate refuses it"


def prompt_changed(text: str | None, limit: int) -> dict[str, Any]:
    """The prompt box's update on each change: its counter only (the text stays as typed)."""
    return {"info": prompt_info(len(text or ""), limit), "__type__": "update"}


#: What more steps do to a model served here, where people choose them (measured: docs/tiny-shapes.md).
STEP_NOTES = {
    "tiny-shapes": "tiny-shapes is trained for 4 steps (the default): 1 to 4 draw the same clean shape, 8 and more "
    "make its edges ragged",
}
#: Beside a live step preview: it is the noisy image of that step, so it shows little until the last steps.
PREVIEW_NOTE = " · the preview is this step's noisy image: the shape shows only in the last steps"


def steps_info(max_steps: int, model: str = "") -> str:
    """The slider clamps a larger number typed in its box; the note says so before it happens, and what more
    steps do to the model served (tiny-shapes: worse, not better)."""
    clamp = f"1 to {max_steps} (max_steps); a larger number typed here is set to {max_steps}"
    return f"{clamp}. {STEP_NOTES[model]}" if model in STEP_NOTES else clamp


def count_prompt(prompt: Any, limit: int) -> None:
    """Wire the counter to the prompt box (inside the Blocks): outside the queue, no device lane."""
    prompt.change(
        lambda text: prompt_changed(text, limit),
        inputs=[prompt],
        outputs=[prompt],
        queue=False,
        api_visibility="private",
        show_progress="hidden",
    )
