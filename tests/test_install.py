"""What each requirements file installs: the single-process quick start pulls no Ray; the replicas file adds it.

Read from the requirement files and this environment's installed metadata (no install, no network): the closure
of `requirements.txt` is every distribution its pins require, transitively, with their extras.
"""

from __future__ import annotations

import importlib.metadata as md

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import ROOT


def pins(name: str) -> list[Requirement]:
    """The requirements of one file, following `-r` includes."""
    found: list[Requirement] = []
    for raw in (ROOT / name).read_text().splitlines():
        line = raw.split(" #")[0].strip()
        if line.startswith("-r "):
            found += pins(line[3:].strip())
        elif line and not line.startswith(("#", "-")):
            found.append(Requirement(line))
    return found


def closure(requirements: list[Requirement]) -> set[str]:
    """Every installed distribution these requirements pull in (markers evaluated here, extras followed)."""
    installed = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
    extras: dict[str, set[str]] = {}
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name not in installed:
            continue  # e.g. a platform-only dependency not installed here
        known = extras.get(name)
        if known is not None and set(req.extras) <= known:
            continue
        extras[name] = (known or set()) | set(req.extras)
        for spec in installed[name].requires or []:
            dep = Requirement(spec)
            environments = [{"extra": extra} for extra in extras[name] | {""}]
            if dep.marker is None or any(dep.marker.evaluate(env) for env in environments):
                todo.append(dep)
    return set(extras)


def test_the_single_process_install_pulls_no_ray() -> None:
    quick_start = closure(pins("requirements.txt"))
    assert {"gradio", "diffusers", "torch"} <= quick_start  # the walk really follows the pins
    assert not any(name == "ray" or name.startswith("ray-") for name in quick_start), sorted(quick_start)
    assert "ray" in closure(pins("requirements-replicas.txt"))


def test_ray_is_pinned_once_and_the_dev_and_replica_installs_include_it() -> None:
    files = ["requirements.txt", "requirements-common.txt", "requirements-dev.txt", "requirements-replicas.txt"]
    direct = {name: [r for r in pins(name) if r.name == "ray"] for name in files}
    assert [str(r) for r in pins("requirements-replicas.txt")] == ["ray[serve]==2.58.0"]
    assert direct["requirements.txt"] == direct["requirements-common.txt"] == []
    assert [str(r) for r in direct["requirements-dev.txt"]] == ["ray[serve]==2.58.0"]  # through -r
    assert "requirements-replicas.txt" in (ROOT / "docs" / "replicas.md").read_text()
    assert "requirements-replicas.txt" in (ROOT / "Dockerfile").read_text()
