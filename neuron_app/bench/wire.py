"""Gradio's queue protocol spoken directly (join, then the event stream), to time the server without the client.

gradio_client checks its message queue every 50 ms, so its round trips come in 50 ms steps and hide what the
server itself adds. This client reads the stream as it arrives: one persistent connection, no polling. It times;
correctness through the real client is measured next to it (and in the tests).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any


class WireClient:
    """POST /gradio_api/queue/join, then read /gradio_api/queue/data until `process_completed`."""

    def __init__(self, url: str, timeout: float = 300.0) -> None:
        import httpx

        self.base = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout)
        config = self.http.get(self.base + "/config").json()
        self.fn_index = {d.get("api_name"): i for i, d in enumerate(config["dependencies"]) if d.get("api_name")}

    def event(self, fn_index: int, data: list[Any]) -> dict[str, Any]:
        """Send one event (named or not: the page's own events have only an index); its `process_completed`."""
        session = uuid.uuid4().hex[:12]
        body = {"data": data, "fn_index": fn_index, "session_hash": session, "trigger_id": None, "event_data": None}
        self.http.post(self.base + "/gradio_api/queue/join", json=body).raise_for_status()
        with self.http.stream("GET", self.base + "/gradio_api/queue/data", params={"session_hash": session}) as s:
            for line in s.iter_lines():
                if line.startswith("data:") and (message := json.loads(line[5:])).get("msg") == "process_completed":
                    return message
        raise RuntimeError(f"event {fn_index}: the event stream ended without an answer")

    def call(self, api_name: str, *data: Any, download: bool = False) -> tuple[float, list[Any]]:
        """Seconds from sending the request to holding its answer (and the first output file, if `download`)."""
        start = time.perf_counter()
        message = self.event(self.fn_index[api_name], list(data))
        if not message.get("success", True):
            raise RuntimeError(f"{api_name} failed: {message.get('output')}")
        output = message["output"]["data"]
        if download:
            self.http.get(output[0]["url"]).raise_for_status()
        return time.perf_counter() - start, output

    def close(self) -> None:
        self.http.close()
