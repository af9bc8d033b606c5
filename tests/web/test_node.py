"""docs/api.md's Node examples, run: @gradio/client, the openai Node SDK and the MCP TypeScript SDK against the
launched app (tests/node/clients.mjs; packages pinned in tests/node/package-lock.json).

The README's one test command needs no other step: when tests/node's packages are missing or not the pinned
versions, the test runs `npm ci --prefix tests/node` itself (from the npm registry), under a file lock so that two
pytest workers or runs never install into the same folder at once. Node and npm are system packages (like the
browser test's chromium): without them the test fails with the command that installs them, since a skip would
let the README's "whole suite" pass with the docs' Node examples unchecked."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from neuron_app.verify import configured_signer, verify_file
from tests.support import ROOT

NODE_DIR = ROOT / "tests" / "node"
#: Debian's packages (node 18 or later), the same line the README gives for the suite's system packages.
SYSTEM_PACKAGES = "apt-get install nodejs npm"


def pinned_missing(node_dir: Path) -> list[str]:
    """The packages of node_dir's package.json not installed at their pinned version (all of them when
    node_modules is absent)."""
    wanted = json.loads((node_dir / "package.json").read_text())["dependencies"]
    missing = []
    for name, version in wanted.items():
        installed = node_dir / "node_modules" / name / "package.json"
        if not installed.is_file() or json.loads(installed.read_text()).get("version") != version:
            missing.append(f"{name}@{version}")
    return missing


def node_clients_ready(node_dir: Path = NODE_DIR) -> str:
    """The path of node, with node_dir's pinned packages installed (`npm ci`, once, under a lock); fails with the
    system packages to install when node or npm is absent."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail(f"node and npm are needed for docs/api.md's Node examples: {SYSTEM_PACKAGES} (see README, Tests)")
    with FileLock(str(node_dir / "node_modules.lock")):  # git-ignored beside node_modules
        if pinned_missing(node_dir):
            done = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                cwd=node_dir,
                capture_output=True,
                text=True,
                timeout=900,
            )
            if done.returncode != 0:
                pytest.fail(f"`npm ci --prefix tests/node` failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        still = pinned_missing(node_dir)
        assert not still, f"npm ci left these packages out: {still}"
    return node


@pytest.mark.slow
def test_the_node_clients_of_the_docs_work(launched_app: Any, tmp_path: Path) -> None:
    node = node_clients_ready()
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
