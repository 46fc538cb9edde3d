"""Imports run downward: no module imports one of a higher layer (docs/architecture.md).

Every module of the checked packages is parsed with `ast`, not imported, so the test
sees imports inside functions too (those that load a heavy stack on first use). Imports
under `if TYPE_CHECKING:` are exempt: they name types for annotations and run nothing.
tests/ and notebooks/ are not checked.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The top-level packages, lowest first: each may import those before it.
TOP_LEVEL_LAYERS = ("kernels_pallas", "jpaged", "experiments", "benchmarks")

# Inside jpaged, lowest first. Each row names root modules (jpaged.config) or
# subpackages (jpaged.memory, which places every module under it); a module may import
# its own row and the rows before it. jpaged.worker may not exist yet.
JPAGED_LAYERS = (
    # The plain types and helpers that the rest uses.
    ("jpaged.config", "jpaged.errors", "jpaged._deprecation", "jpaged.inputs",
     "jpaged.sampling_params", "jpaged.sequence", "jpaged.outputs", "jpaged.suggestions"),
    # The host side: the allocator and managers below, the scheduler that drives them above.
    ("jpaged.memory",),
    # LoRA adapters on the host: requests, PEFT files read and checked, the slot table
    # the scheduler hands out.
    ("jpaged.lora",),
    ("jpaged.core",),
    # Host-side grammars of structured outputs: the scheduler advances them through the
    # sequences it holds, the worker fills their masks.
    ("jpaged.structured_output",),
    # The device side.
    ("jpaged.model",),
    ("jpaged.worker",),
    ("jpaged.speculative",),
    ("jpaged.engine",),
    ("jpaged.entrypoints",),
    # What starts things: the package facade, the command line, the multi-host launcher;
    # and the docs' tables generated from the command line.
    ("jpaged", "jpaged.__main__", "jpaged.launch", "jpaged.reference_tables"),
)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}: {self.importer} -> {self.imported}"


def module_name(path: Path) -> str:
    """jpaged/memory/allocator.py -> jpaged.memory.allocator; a package's __init__.py
    is the package."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path
            for top in TOP_LEVEL_LAYERS for path in sorted((REPO / top).rglob("*.py"))}


def is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_import_nodes(nodes):
    """Every import statement among `nodes`, at any depth, outside `if TYPE_CHECKING:`
    bodies."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif is_type_checking_block(node):
            yield from runtime_import_nodes(node.orelse)
        else:
            yield from runtime_import_nodes(ast.iter_child_nodes(node))


def from_base(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module a `from ... import` names, relative imports resolved."""
    if not node.level:
        return node.module
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imports_of(importer: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The project modules `importer` imports; `from pkg import sub` names pkg.sub
    when that is a module."""
    found = []
    for node in runtime_import_nodes(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = from_base(node, importer, path.name == "__init__.py")
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        found += [Import(importer, target, path, node.lineno)
                  for target in dict.fromkeys(targets) if target in modules]
    return found


def jpaged_unit(module: str) -> str:
    """The name that places a jpaged module in JPAGED_LAYERS: itself at the package's
    root, else its subpackage (jpaged.memory.allocator -> jpaged.memory)."""
    parts = module.split(".")
    return module if len(parts) <= 2 else ".".join(parts[:2])


JPAGED_RANK = {unit: rank for rank, row in enumerate(JPAGED_LAYERS) for unit in row}


def rank(module: str) -> tuple[int, int]:
    """Where a module sits: its top-level layer, then (inside jpaged) its row."""
    top = module.partition(".")[0]
    inner = JPAGED_RANK[jpaged_unit(module)] if top == "jpaged" else 0
    return TOP_LEVEL_LAYERS.index(top), inner


def all_imports() -> list[Import]:
    modules = project_modules()
    return [found for module, path in modules.items()
            for found in imports_of(module, path, modules)]


def test_every_jpaged_module_has_a_layer():
    units = {jpaged_unit(module) for module in project_modules() if module.startswith("jpaged")}
    unplaced = sorted(units - set(JPAGED_RANK))
    assert not unplaced, f"place these in JPAGED_LAYERS: {unplaced}"


def test_imports_run_downward():
    upward = [str(found) for found in all_imports()
              if rank(found.imported) > rank(found.importer)]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_the_parser_sees_every_form_of_import(tmp_path):
    """Absolute, submodule, relative and function-level imports are seen; TYPE_CHECKING
    ones are not."""
    module = tmp_path / "module.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "import pkg.low.a\n"
        "from pkg.low import b\n"
        "from . import sibling\n"
        "from ..low.c import name\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.top import Facade\n"
        "def later():\n"
        "    from pkg.high import d\n")
    modules = dict.fromkeys(["pkg.low.a", "pkg.low.b", "pkg.low.c", "pkg.mid.sibling",
                             "pkg.top", "pkg.high", "pkg.high.d"])
    seen = [found.imported for found in imports_of("pkg.mid.module", module, modules)]
    assert seen == ["pkg.low.a", "pkg.low.b", "pkg.mid.sibling", "pkg.low.c", "pkg.high.d"]
