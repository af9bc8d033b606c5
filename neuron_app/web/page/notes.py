"""What the page's inputs say about themselves, so nothing is cut or clamped without a word: the prompt box's
counter (a text over the limit is not cut, as the browser's `maxlength` did silently, but named, and refused as
the API refuses it), the steps slider's range and what it does above it."""

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


def steps_info(max_steps: int) -> str:
    """The slider clamps a larger number typed in its box; the note says so before it happens."""
    return f"1 to {max_steps} (max_steps); a larger number typed here is set to {max_steps}"


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
