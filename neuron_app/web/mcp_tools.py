"""Gradio's MCP server (`launch(mcp_server=True)`): our named endpoints `generate` and `status` become tools.

Gradio 6.31 builds each tool from the event function's docstring and the endpoint's types (web/ui.py
writes those docstrings with the configured shapes and step range). One mend: a tool call without a
progress token takes Gradio's fast path, which wraps a multi-output result in one more list, so
`generate` (image, record) would come back as the text of a tuple instead of an image and a record.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def mend_multi_output(demo: Any) -> None:
    """Give multi-output tools their outputs one by one on Gradio's no-progress path (as on its other path)."""
    server = getattr(demo, "mcp_server_obj", None)
    original = getattr(server, "_execute_tool_without_progress", None)
    if original is None or getattr(original, "_mended", False):
        return  # MCP off, or a Gradio that no longer has this path

    async def execute(job: Any) -> list[Any]:
        outputs = await original(job)
        if len(outputs) == 1 and isinstance(outputs[0], tuple):  # gradio_client's multi-output result
            return list(outputs[0])
        return outputs

    execute._mended = True  # type: ignore[attr-defined]
    server._execute_tool_without_progress = execute
