"""docs/api.md's Node examples, run: @gradio/client, the openai Node SDK and the MCP TypeScript SDK against the
launched app (tests/node/clients.mjs; packages pinned in tests/node/package.json, installed by .ci/run)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from neuron_app.verify import configured_signer, verify_file
from tests.support import ROOT

NODE_DIR = ROOT / "tests" / "node"


@pytest.mark.slow
def test_the_node_clients_of_the_docs_work(launched_app: Any, tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "@gradio" / "client").is_dir():
        pytest.fail("node and tests/node's packages are needed: `npm ci --prefix tests/node` (.ci/run does it)")
    done = subprocess.run(
        [node, "clients.mjs", launched_app.url], cwd=NODE_DIR, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    record = seen["gradio"]["record"]  # positional, the optional inputs left out: padded with null, defaults taken
    assert (record["resolution"], record["lora"], record["lora_scale"]) == ("64x64", "none", 1.0)
    assert seen["gradio"]["refusal"] == "steps must be between 1 and 8, got 99"  # events: ["data", "status"]
    assert seen["gradio"]["labels"] == ["prompt", "resolution", "steps", "seed", "lora", "lora_scale", "loras"]
    assert seen["openai"]["size"] == "64x64" and seen["openai"]["b64"] and seen["openai"]["type"] == "application/json"
    assert seen["openai"]["refusal"] == {"status": 400, "code": "invalid_value", "param": "response_format"}
    assert seen["openai"]["job"] == {"status": "succeeded", "images": 1}
    stream = seen["openai"]["stream"]
    assert stream["types"] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert stream["indexes"] == [0, 1] and stream["refusal"] == {"status": 400, "param": "partial_images"}
    final = tmp_path / "streamed.png"
    final.write_bytes(base64.b64decode(stream["completed"]))
    settings = launched_app.settings
    report = verify_file(final, settings.watermark_payload.encode("ascii"), configured_signer(settings))
    assert report.proof and "iptc" in report.ours, report.lines  # 64x64: under the watermark's 256 px
    assert seen["mcp"]["tools"] == ["cancel_job", "edit", "generate", "inpaint", "status"] and seen["mcp"][
        "status"
    ] == ["text"]
