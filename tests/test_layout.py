"""The layout's rule on who imports the kernels (README, "Layout"): the primitives' launches and
``detsum._kernel_ops`` do; consumers and adapters call the primitives and ``_kernel_ops``, and
never import ``detsum.kernels``, so that which backend runs is decided in one place."""

from __future__ import annotations

import ast
import pathlib

import pytest

import detsum

PACKAGE = pathlib.Path(detsum.__file__).parent

#: The modules of detsum/ that may import detsum.kernels, and why.
MAY_IMPORT_KERNELS = {
    "_kernel_ops.py": "the consumers' kernels, and the choice of backend that runs them",
    "_segments.py": "the primitives' launch",
    "plans.py": "a plan's chunk split, as the launch takes it",
    "_replay.py": "a call's launches made again from their records, as plans.py's are",
    "modes.py": "the rule each mode stands for, and the numbers of the modes' arithmetic",
    "backend.py": "whether the Triton kernels were made for the interpreter",
    "ops/segment_sum.py": "a primitive",
    "ops/index_add.py": "a primitive",
    "ops/scatter_reduce.py": "a primitive",
}


def _is_kernels(name: str) -> bool:
    return name == "detsum.kernels" or name.startswith("detsum.kernels.")


def kernel_imports(source: str, module: str) -> list[int]:
    """The lines of ``source`` (the module ``module``, dotted) that import detsum.kernels or
    a module in it: ``import``, ``from ... import`` (absolute or relative), and
    ``importlib.import_module`` or ``__import__`` of a literal name."""
    package = module.rsplit(".", 1)[0]
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                             "__import__")):
            names = [node.args[0].value]
        else:
            continue
        if any(_is_kernels(name) for name in names):
            lines.append(node.lineno)
    return sorted(lines)


def modules() -> list[tuple[str, str]]:
    """(path under detsum/, dotted name) of every module of detsum/."""
    # A package's __init__ keeps its name, "detsum.ops.__init__": relative imports in it, as
    # in its modules, start from the package.
    return [(path.relative_to(PACKAGE).as_posix(),
             ".".join(["detsum", *path.relative_to(PACKAGE).with_suffix("").parts]))
            for path in sorted(PACKAGE.rglob("*.py"))]


def test_only_the_launches_and_the_kernel_door_import_the_kernels():
    offenders = {}
    for relative, module in modules():
        if relative in MAY_IMPORT_KERNELS:
            continue
        lines = kernel_imports((PACKAGE / relative).read_text(), module)
        if lines:
            offenders[relative] = lines
    assert not offenders, (
        f"these modules import detsum.kernels (file: lines): {offenders}; expected them to "
        f"call the primitives or detsum._kernel_ops instead, and to take the modes' numbers "
        f"from detsum.modes")


def test_the_allowed_modules_exist():
    """A module renamed or removed leaves its entry behind, and the rule would let a new
    module of that name import the kernels unseen."""
    assert sorted(m for m in MAY_IMPORT_KERNELS if not (PACKAGE / m).is_file()) == []


@pytest.mark.parametrize("source, module", [
    ("import detsum.kernels.numba", "detsum.report"),
    ("import detsum.kernels as k", "detsum.report"),
    ("from detsum.kernels import CHUNK_TERMS", "detsum.moe"),
    ("from detsum.kernels.numba import wire", "detsum.distributed"),
    ("from detsum import _segments, kernels", "detsum.loss"),
    ("from . import kernels", "detsum.loss"),
    ("from .kernels.numba.weighted import row_dots", "detsum.moe"),
    ("from .. import kernels", "detsum.ops.running_sum"),
    ("from ..kernels import WIDE", "detsum.ops.running_sum"),
    ("def f():\n    from detsum.kernels.numba.outer import resume_products", "detsum.ops.x"),
    ("import importlib\nimportlib.import_module('detsum.kernels.numba')", "detsum.report"),
])
def test_every_form_of_import_is_found(source, module):
    assert kernel_imports(source, module) == [source.count("\n") + 1]


@pytest.mark.parametrize("source, module", [
    ("from detsum import _kernel_ops", "detsum.moe"),
    ("from detsum.modes import CHUNK_TERMS", "detsum.moe"),
    ("from . import _kernel_ops", "detsum.ops.running_sum"),
    ("import kernels", "detsum.moe"),  # another package of that name, not detsum's
    ("text = 'detsum.kernels'", "detsum.moe"),
])
def test_other_imports_are_not_taken_for_the_kernels(source, module):
    assert kernel_imports(source, module) == []


# ---- import circles ------------------------------------------------------------------------------

#: Where kernels/ is installed (pyproject.toml's package-dir): detsum.kernels.
KERNELS = PACKAGE.parent / "kernels"


def module_files() -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of detsum/ and kernels/ (a package by its own
    name, not ``.__init__``)."""
    files = {}
    for prefix, folder in (("detsum", PACKAGE), ("detsum.kernels", KERNELS)):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([prefix, *parts])] = path
    return files


def imported_modules(path: pathlib.Path, module: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (the module ``module``) imports, at its top or
    inside a function: ``from package import module`` names the module, ``from module import
    name`` the module."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return (found & known) - {module}


def circles_through(modules: set[str], graph: dict[str, set[str]]) -> list[list[str]]:
    """For each module of ``modules`` that imports, directly or not, a module that imports it
    back: the shortest such path, from the module back to itself."""
    circles = []
    for start in sorted(modules):
        paths = {start: [start]}
        frontier = [start]
        while frontier and not any(start in graph[m] for m in frontier):
            next_frontier = []
            for m in frontier:
                for n in sorted(graph[m]):
                    if n not in paths:
                        paths[n] = paths[m] + [n]
                        next_frontier.append(n)
            frontier = next_frontier
        back = [m for m in frontier if start in graph[m]]
        if back:
            circles.append(paths[back[0]] + [start])
    return circles


def test_no_import_circle_through_the_kernels_or_the_command_line():
    """Shared helpers live in a module of their own that both users import: the Numba kernels
    (segment and scatter share their variants, exact and exact_state the limbs, every kernel
    the common helpers) and the command line's modules (the report and the figures share
    detsum.measure)."""
    files = module_files()
    graph = {m: imported_modules(path, m, set(files)) for m, path in files.items()}
    watched = {m for m in files if m.startswith("detsum.kernels.")
               or m in ("detsum.report", "detsum.figures", "detsum.measure")}
    assert circles_through(watched, graph) == []


def test_an_import_circle_is_found(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles_through({"a", "d"}, graph) == [["a", "b", "c", "a"]]
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from . import y\nfrom .z import name\n")
    assert imported_modules(source, "p.x", {"p", "p.y", "p.z"}) == {"p.y", "p.z"}
