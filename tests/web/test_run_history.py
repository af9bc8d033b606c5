"""Gradio's run history (`launch(run_history=...)`): off by default where others can reach the server, on for a
private one, and the setting decides when set; checked on the launched app's own routes (docs/sharing.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from neuron_app.settings import load_settings


@pytest.mark.parametrize(
    ("overrides", "on"),
    [
        ({}, True),  # 127.0.0.1: private
        ({"server_name": "localhost"}, True),
        ({"server_name": "0.0.0.0"}, False),  # the network can reach it
        ({"server_name": "10.0.0.5"}, False),
        ({"share": True, "allow_public_without_auth": True}, False),
        ({"server_name": "0.0.0.0", "run_history": True}, True),  # the operator chose
        ({"run_history": False}, False),
    ],
)
def test_run_history_follows_who_can_reach_the_server(overrides: dict[str, Any], on: bool) -> None:
    assert load_settings(**overrides).run_history_on is on


def _runs(app: Any) -> tuple[int, Any]:
    page = httpx.get(app.url + "gradio_api/runs", timeout=30)
    config = httpx.get(app.url + "config", timeout=30).json()
    return page.status_code, config.get("run_history")


def test_launch_passes_the_setting_to_gradio(launch_tiny: Callable[..., Any]) -> None:
    """Off: Gradio's runs page is a 404 and its config tells the browser to record nothing; on (a private server
    by default): the page is served."""
    status, recorded = _runs(launch_tiny(run_history=False))
    assert (status, recorded) == (404, False)
    status, recorded = _runs(launch_tiny())
    assert status != 404 and recorded is True
