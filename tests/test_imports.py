"""Every module of neuron_app imports on this interpreter.

CI's second pass (Python 3.14) runs a few modules' tests, not the whole suite: this one reaches the modules
those tests do not (a syntax, a removed stdlib name or a dependency that breaks there fails here).
"""

from __future__ import annotations

import importlib
import pkgutil

import neuron_app


def test_every_module_imports() -> None:
    names = sorted(m.name for m in pkgutil.walk_packages(neuron_app.__path__, "neuron_app."))
    assert len(names) > 90 and "neuron_app.engine.manager" in names and "neuron_app.web.server" in names
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # every failure named at once, not only the first
            failed[name] = f"{type(exc).__name__}: {exc}"
    assert not failed, failed
