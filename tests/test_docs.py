"""The front-door README stays short and current, and every relative link in README.md and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import ROOT

README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def code_map(page: Path = README, heading: str = "## How it is built") -> str:
    """The first code block under `heading`."""
    section = page.read_text().split(heading, 1)[1]
    return section.split("```", 2)[1]


def map_names(page: Path = README, heading: str = "## How it is built") -> list[str]:
    return re.findall(r"^\s*([\w.]+/?)\s", code_map(page, heading), re.MULTILINE)


def test_readme_is_a_front_door() -> None:
    """At most 120 lines, with the quick start, the test commands and the quick loop."""
    text = README.read_text()
    assert len(text.splitlines()) <= 120
    assert "NEURON_APP_SETTINGS=quickstart.toml python app.py" in text
    assert (
        "python -m pytest -n 2 -p no:randomly\n" in text
        and 'python -m pytest -n 2 -m "not slow and not browser"' in text
    )
    assert "python3 -m pytest -n 2 -p no:randomly\n" in (README.parent / ".ci" / "run").read_text()  # CI runs it


def test_code_map_names_every_module() -> None:
    """Each module of neuron_app/ has its line in docs/architecture.md's map (a folder's line stands for its
    __init__.py), and the README's map names every folder (the rooms), not every file."""
    names = map_names(ARCHITECTURE, "## Every module")
    for path in (ROOT / "neuron_app").rglob("*.py"):
        name = path.parent.name + "/" if path.name == "__init__.py" else path.name
        assert name in names, f"{path.relative_to(ROOT)} is missing from docs/architecture.md's code map"
    listed = {n for n in names if n.endswith(".py")}
    present = {p.name for p in (ROOT / "neuron_app").rglob("*.py")} | {"app.py"}
    assert listed <= present, f"the map lists modules that do not exist: {sorted(listed - present)}"
    inits = [*(ROOT / "neuron_app").glob("*/__init__.py"), *(ROOT / "neuron_app" / "engine").glob("*/__init__.py")]
    rooms = {p.parent.name + "/" for p in inits}
    assert rooms <= set(map_names()), f"README.md's map misses rooms: {sorted(rooms - set(map_names()))}"


def test_relative_links_resolve() -> None:
    """Links and images to files of this repository point at files that exist."""
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_api_docs_say_how_to_see_a_429_at_once_and_why_networkidle_never_fires() -> None:
    """The openai SDKs retry 429s (a limited key waits a minute); the page's 2 s poll keeps the network busy."""
    text = (ROOT / "docs" / "api.md").read_text()
    assert "max_retries=0" in text and "maxRetries: 0" in text
    assert "networkidle" in text and "**From Node.**" in text


def test_the_readme_has_a_two_minute_api_block_with_measured_first_hour_times() -> None:
    text = README.read_text()
    assert "**Try the APIs in two minutes**" in text and "python scripts/first_hour.py" in text
    assert (ROOT / "scripts" / "first_hour.py").is_file()


def test_every_script_answers_help_without_starting_its_work() -> None:
    """`python scripts/X.py --help` prints its usage and exits 0 at once (turn 7's T7-17: first_hour.py started a
    measurement of minutes instead); the timeout is only a guard against a script that starts work."""
    import subprocess
    import sys

    for script in sorted((ROOT / "scripts").glob("*.py")):
        done = subprocess.run(
            [sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and done.stdout.startswith("usage: "), (script.name, done.stdout, done.stderr)
