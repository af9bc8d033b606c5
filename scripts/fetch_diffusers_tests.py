"""Fetch diffusers' FLUX.2-klein pipeline tests, and what they import from diffusers' tests folder, into
third_party/diffusers/ (not committed: third-party code, Apache-2.0), so they can run under the emulator:

    python scripts/fetch_diffusers_tests.py                      # from GitHub, at COMMIT
    python scripts/fetch_diffusers_tests.py --repo PATH/.git     # from a diffusers git checkout or mirror

The installed diffusers is 0.42.1; the newest diffusers source this project could read is COMMIT (2026-08-23, the
snapshot the fourth Neuron review ran): no v0.42.1 tag was in it. Its tests run against the installed 0.42.1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import urllib.request
from pathlib import Path

COMMIT = "58eb52c0803ea9af3abec60841c2a093bdf1f951"
RAW = "https://raw.githubusercontent.com/huggingface/diffusers/{commit}/{path}"
#: The klein test file and every file of diffusers' tests folder it imports (directly or through its mixins).
FILES = [
    "LICENSE",
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/testing_utils.py",
    "tests/pipelines/__init__.py",
    "tests/pipelines/flux2/__init__.py",
    "tests/pipelines/flux2/test_pipeline_flux2_klein.py",
    *(
        f"tests/pipelines/testing_utils/{name}.py"
        for name in ("__init__", "cache", "common", "lora", "memory", "quantization", "utils")
    ),
    "tests/models/__init__.py",
    *(
        f"tests/models/testing_utils/{name}.py"
        for name in (
            "__init__",
            "attention",
            "cache",
            "common",
            "compile",
            "ip_adapter",
            "lora",
            "memory",
            "parallelism",
            "quantization",
            "single_file",
            "training",
            "utils",
        )
    ),
]
TARGET = Path(__file__).resolve().parents[1] / "third_party" / "diffusers"
README = """# diffusers' FLUX.2-klein pipeline tests (third-party, not committed)

From https://github.com/huggingface/diffusers at commit {commit}, under the Apache License 2.0 (LICENSE, here).
Written by scripts/fetch_diffusers_tests.py; unchanged. Run under the emulator as docs/neuron-emulator.md says.
"""


def read(path: str, repo: Path | None) -> bytes:
    if repo is not None:
        return subprocess.run(
            ["git", f"--git-dir={repo}", "show", f"{COMMIT}:{path}"], check=True, capture_output=True
        ).stdout
    with urllib.request.urlopen(RAW.format(commit=COMMIT, path=path), timeout=60) as answer:
        return answer.read()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, help="a diffusers git directory holding the commit (else GitHub)")
    args = parser.parse_args(argv)
    for path in FILES:
        out = TARGET / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(read(path, args.repo))
    (TARGET / "README.md").write_text(README.format(commit=COMMIT))
    print(f"{len(FILES)} files from diffusers {COMMIT[:10]} in {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
