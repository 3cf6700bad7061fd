"""The packages of phalanx import in one direction, bottom to top (docs/DESIGN.md):

    config, fsutil, precision  <-  core  <-  mesh  <-  layers, data, checkpoint  <-  models  <-  parallel, prune
        <-  plan, cluster  <-  engines  <-  export  <-  train  <-  api, cli, commands

A module may import its own package and any package below it, never one above (function-
local imports included: a cycle dodged inside a function is still a cycle). ``from
phalanx.pkg import module`` counts as an import of ``phalanx.pkg.module``. A command-line
module has the level of the package it lives in (``data/cli.py`` is ``data``); a command that
needs packages above its own lives in ``commands`` at the top. ``KNOWN`` lists
the imports against the direction that the code still has, each to be removed by moving
the module that causes it; the test fails on any new one, and on a listed one that is gone
(so the list only shrinks).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "phalanx"

LEVELS = [
    ("config", "fsutil", "precision"),
    ("core",),
    ("mesh",),
    ("layers", "data", "checkpoint"),
    ("models",),
    ("parallel", "prune"),
    ("plan", "cluster"),
    ("engines",),
    ("export",),
    ("train",),
    ("api", "cli", "commands", "__init__", "__main__"),
]
RANK = {package: level for level, packages in enumerate(LEVELS) for package in packages}

# importer module -> imported module, still against the direction (none left; keep it empty).
KNOWN: set[tuple[str, str]] = set()


def package_of(module: str) -> str:
    """The package whose level ``module`` has: the one it lives in, command-line modules
    included (``phalanx.data.cli`` is ``data``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> set[tuple[str, str]]:
    """Every (importer, imported) pair of phalanx modules, module-level and function-local."""
    found = set()
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from phalanx.core import optim` imports the module phalanx.core.optim
                names = [f"{node.module}.{alias.name}" if _is_module(f"{node.module}.{alias.name}") else node.module
                         for alias in node.names]
            else:
                continue
            found.update((module, name) for name in names if name.startswith("phalanx."))
    return found


def test_the_scan_sees_every_form_of_import():
    pairs = imports()
    assert ("phalanx.engines.keras_gpt", "phalanx.core.optim") in pairs  # from phalanx.core import optim
    assert ("phalanx.engines.keras_gpt", "phalanx.prune") in pairs      # from phalanx import prune
    assert ("phalanx.engines.factory", "phalanx.engines.ps_gpt") in pairs  # from phalanx.x.y import Name


def test_every_package_has_a_level():
    packages = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
                if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert packages - set(RANK) == set(), "give the new package a level in LEVELS (and docs/DESIGN.md)"


def test_a_command_module_has_its_package_level():
    assert package_of("phalanx.train.cli") == "train"
    assert package_of("phalanx.data.cli") == "data"
    assert package_of("phalanx.commands.plan") == "commands"
    assert package_of("phalanx.cli") == "cli"


def test_no_package_cycle():
    """No two packages import each other, directly or through others (a cycle through a
    function-local import or a command module counts)."""
    edges: dict[str, set[str]] = {}
    for a, b in imports():
        if package_of(a) != package_of(b):
            edges.setdefault(package_of(a), set()).add(package_of(b))

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(p for p in edges if p in reach(p))
    assert not cycles, f"packages on an import cycle: {cycles}"


def test_imports_follow_the_direction():
    against = {(a, b) for a, b in imports() if RANK[package_of(b)] > RANK[package_of(a)]}
    new = against - KNOWN
    assert not new, "imports against the direction (move the code, do not import upwards):\n" + \
        "\n".join(f"  {a} -> {b}" for a, b in sorted(new))
    gone = KNOWN - against
    assert not gone, f"remove from KNOWN, they are fixed: {sorted(gone)}"
