"""The page's first render shows the state of now, not the state at launch.

Gradio serves the page's component values from the config it built once, at launch: with `load_on_start` the
model loads after that, so every page first said "loads on the first request" and "Cache (0 B)" until the
status timer's first tick. `install` makes each page load (and /config) write the current values in first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Component id -> the props to serve now ({"value": ...}, {"choices": ..., "info": ...}).
Props = Callable[[], dict[int, dict[str, Any]]]


class LiveConfig(dict):  # type: ignore[type-arg]
    """Gradio's config dict; reading its components first refreshes the props `fresh` returns."""

    def __init__(self, config: dict[str, Any], fresh: Props) -> None:
        super().__init__(config)
        self._fresh = fresh

    def _refresh(self) -> None:
        try:
            props = self._fresh()
        except Exception:  # a page with the launch-time values beats no page
            log.exception("could not refresh the page's first render")
            return
        for component in super().__getitem__("components"):
            component["props"].update(props.get(component["id"], {}))

    def __getitem__(self, key: str) -> Any:
        if key == "components":  # the page route reads config["components"]
            self._refresh()
        return super().__getitem__(key)

    def items(self) -> Any:  # /config deep-copies the whole dict, which reads its items
        self._refresh()
        return super().items()


def install(demo: Any) -> None:
    """After `launch`: serve `demo.first_render()` (set by web/page/ui.py) in every page's config."""
    fresh = getattr(demo, "first_render", None)
    config = getattr(demo, "config", None)
    if fresh is None or not isinstance(config, dict) or isinstance(config, LiveConfig):
        return
    demo.config = LiveConfig(config, fresh)
