"""docs/architecture.md's first diagram is the import rule: every box exists, and every import between two boxes
goes along an arrow. Read from the code's own imports (ast), so a new import against the rule fails here."""

from __future__ import annotations

import ast
import re

from tests.support import ROOT

PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "neuron_app"
ROOMS = ("model", "compile", "cache", "remote", "modes", "trust", "output")
CLI = {"__main__", "commands", "doctor", "doctor_stack", "verify", "selftest"}
WINGS = ("web", "scale", "backends", "bench", "training")
#: web/'s rooms, each a box of its own; `server` (web/server.py) composes them, `web` is the rest of its top level.
WEB_ROOMS = ("page", "openai", "jobs", "mcp")


def diagrams() -> list[str]:
    return re.findall(r"```mermaid\n(.*?)```", PAGE.read_text(), re.DOTALL)


def drawn() -> tuple[set[str], set[tuple[str, str]]]:
    """The first diagram's boxes and arrows."""
    text = diagrams()[0]
    boxes = set(re.findall(r"^\s*(\w+)\[", text, re.MULTILINE))
    arrows = set(re.findall(r"^\s*(\w+) --> (\w+)\s*$", text, re.MULTILINE))
    return boxes, arrows


def box_of(module: str) -> str | None:
    """The diagram box a dotted module name belongs to; None for outside the package, "base" for its top level."""
    parts = module.split(".")
    if parts[0] != "neuron_app":
        return None
    if len(parts) == 1 or parts[1] not in {"engine", *WINGS, *CLI}:
        return "base"
    if parts[1] in CLI:
        return "cli"
    if parts[1] == "web" and len(parts) > 2:
        return parts[2] if parts[2] in {*WEB_ROOMS, "server"} else "web"
    if parts[1] != "engine":
        return parts[1]
    if len(parts) > 2 and parts[2] in ROOMS:
        return parts[2]
    return "records" if len(parts) > 2 and parts[2] in {"records", "observers"} else "engine"


def module_name(path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    name = ".".join(rel.parts)
    return name.removesuffix(".__init__")


def is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> list[tuple[str, str, str]]:
    """(box, imported box, where) for every import of one box from another, lazy imports included."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        here = module_name(path)
        source = box_of(here)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from neuron_app.engine import requests` imports a module; `from x import Name`, a name of x.
                names = [f"{node.module}.{a.name}" for a in node.names]
                targets = [n if is_module(n) else node.module for n in names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                box = box_of(target)
                if box and box not in {source, "base"}:
                    found.append((source, box, f"{here}:{node.lineno} imports {target}"))
    return found


def test_every_room_in_the_diagram_exists() -> None:
    boxes, arrows = drawn()
    assert {a for arrow in arrows for a in arrow} <= boxes, "an arrow names a box the diagram does not draw"
    for room in ROOMS:
        assert room in boxes, f"engine/{room}/ is not drawn"
        assert (PACKAGE / "engine" / room / "__init__.py").is_file(), f"the diagram draws engine/{room}/, absent"
    for wing in WINGS:
        assert wing in boxes and (PACKAGE / wing / "__init__.py").is_file()
    on_disk = {p.parent.name for p in (PACKAGE / "engine").glob("*/__init__.py")}
    assert on_disk <= set(ROOMS), f"rooms the diagram does not draw: {sorted(on_disk - set(ROOMS))}"


def test_no_import_goes_against_an_arrow() -> None:
    _, arrows = drawn()
    against = [where for source, target, where in imports() if (source, target) not in arrows]
    assert not against, "imports the diagram does not allow:\n" + "\n".join(sorted(against))
    assert not {(b, a) for a, b in arrows} & arrows, "two boxes import each other"


def test_the_request_path_diagram_names_real_files() -> None:
    """Every file the second diagram names exists."""
    for path in set(re.findall(r"((?:web|engine|scale|backends)/[\w/]+\.py)", diagrams()[1])):
        assert (PACKAGE / path).is_file(), f"the request path names {path}, absent"


def test_each_room_says_what_it_holds() -> None:
    for init in (PACKAGE / "engine").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.splitlines()) == 1, f"{init.relative_to(ROOT)}: one line saying what it holds"
    for room in (PACKAGE / "engine").glob("*/"):
        assert len(list(room.glob("*.py"))) <= 10, f"engine/{room.name}/ holds more than 10 files"


def test_no_room_outgrows_itself() -> None:
    """A folder past 12 Python files, or a module past 400 lines, is split along its seams before it grows."""
    crowded = {
        str(folder.relative_to(ROOT)): count
        for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]
        if (count := len(list(folder.glob("*.py")))) > 12
    }
    assert not crowded, f"folders over 12 Python files: {crowded}"
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_web_rooms_and_the_training_wing_stand_apart() -> None:
    """web/'s rooms import one another only through the arrows drawn (jobs for the OpenAI API and MCP's cancel);
    the engine does not train: nothing under engine/ is a trainer, and nothing serving imports training/."""
    for room in WEB_ROOMS:
        assert (PACKAGE / "web" / room / "__init__.py").is_file(), f"web/{room}/ is drawn but absent"
    assert not list((PACKAGE / "engine").rglob("training/*.py"))
    serving = [where for source, target, where in imports() if target == "training" and source != "cli"]
    assert not serving, serving
