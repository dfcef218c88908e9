"""The import graph of liger_lab, read from the source (every ``import``, also those inside a function).

The package is built in layers (CONTRIBUTING.md, "Layout, layer by layer"): a module imports its own layer and the
layers below, never one above, and no two modules import each other, directly or round a circle. Inside the Hugging
Face layer the files also stand in an order (the ``liger_lab.hf`` docstring's). The old paths of moved modules are
kept for old imports and pickles only: nothing in the repository imports them.
"""

import ast
import importlib
import json
import pathlib

import pytest

import liger_lab

PACKAGE = pathlib.Path(liger_lab.__file__).parent
ROOT = PACKAGE.parent

LAYERS = [
    ("runtime", ["liger_lab.runtime"]),
    ("kernels", ["liger_lab.formulas", "liger_lab.reference", "liger_lab.ops", "liger_lab.nn"]),
    ("hf", ["liger_lab.hf", "liger_lab.patching"]),
    ("library", ["liger_lab", "liger_lab.trl_head", "liger_lab.profiling", "liger_lab.e2e", "liger_lab.distributed"]),
    ("workbook", ["liger_lab.workbook", "liger_lab.checks", "liger_lab.exercises", "liger_lab.chapters",
                  "liger_lab.diagrams", "liger_lab.results"]),
    ("tools", ["liger_lab.op_table", "liger_lab.op_checks", "liger_lab.bench", "liger_lab.doctor", "liger_lab.cli",
               "liger_lab.__main__"]),
]  # fmt: skip
"""From the bottom up: each layer's modules and packages. The root, ``liger_lab`` itself, exposes the library (the
ops, ``patch``, ``patch_trl``) and sits with it; the tools above the teaching layer read everything."""

ALIASES = {
    "liger_lab.checks": "liger_lab.workbook.checks",
    "liger_lab.exercises": "liger_lab.workbook.exercises",
    "liger_lab.chapters": "liger_lab.workbook.chapters",
    "liger_lab.diagrams": "liger_lab.workbook.diagrams",
    "liger_lab.results": "liger_lab.workbook.results",
    "liger_lab.patching": "liger_lab.hf",
    "liger_lab.ops.swiglu": "liger_lab.ops.glu",
}
"""The old path of each moved module, and where it is now."""

HF_ORDER = ["registry", "families", "modules", "loss", "api", "report", "hub_kernels"]
"""The files of liger_lab.hf from the bottom up: each imports only those before it (the package docstring's order)."""


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str:
    """The module of the package that an imported dotted name is, or is in (a name of a module: its module)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def source_of(path: pathlib.Path) -> str:
    """A Python file's text, or a notebook's code cells joined (IPython's ``%`` and ``!`` lines left out)."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = [cell["source"] for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]
    lines = ("".join(cell) if isinstance(cell, list) else cell for cell in cells)
    return "\n".join(line for text in lines for line in text.splitlines() if not line.lstrip().startswith(("%", "!")))


def imports(path: pathlib.Path, package: str | None = None) -> set[str]:
    """The modules of liger_lab that a file imports. ``from liger_lab.hf import api`` imports ``liger_lab.hf.api``,
    ``from liger_lab import patch`` the root (``patch`` is a name of its ``__init__``)."""
    names = set()
    for node in ast.walk(ast.parse(source_of(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.partition(".")[0] == "liger_lab"}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from inside the package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            if module.partition(".")[0] == "liger_lab":
                names |= {
                    f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module for alias in node.names
                }
    return {resolve(name) for name in names}


def package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


GRAPH = {name: imports(path, package_of(name)) - {name} for name, path in MODULES.items()}


def layer_of(name: str) -> int:
    """The index in :data:`LAYERS` of the layer whose longest prefix names the module."""
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if name == prefix or (prefix != "liger_lab" and name.startswith(prefix + "."))
    ]
    assert matches, f"{name} is in no layer: give it one in LAYERS (and in CONTRIBUTING.md)"
    return max(matches)[1]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: the strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_no_import_circle_in_the_package():
    assert circles(GRAPH) == []


def test_a_circle_is_found():
    """The check itself: a circle of three is reported, a chain is not."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {other} ({LAYERS[layer_of(other)][0]})"
        for name, imported in GRAPH.items()
        for other in sorted(imported)
        if layer_of(other) > layer_of(name)
    ]
    assert not upward, "\n".join(upward)


def test_the_reference_imports_no_kernel_module():
    """The float64 specification shares only :mod:`liger_lab.formulas` with the kernels, which imports no kernel
    module either: a bug in a helper of a kernel cannot pass the checks that should catch it."""
    assert GRAPH["liger_lab.reference"] <= {"liger_lab.formulas"}
    assert GRAPH["liger_lab.formulas"] <= {"liger_lab.ops.common", "liger_lab.runtime"}


def test_the_hf_files_import_only_those_below():
    """No import circle among the files, and the swap mechanics never import the fused modules they serve; the
    package's ``__init__`` is imported by none of them."""
    files = sorted(name.rpartition(".")[2] for name in MODULES if name.startswith("liger_lab.hf."))
    assert files == sorted(HF_ORDER)
    for index, stem in enumerate(HF_ORDER):
        imported = {name for name in GRAPH[f"liger_lab.hf.{stem}"] if name.startswith("liger_lab.hf")}
        below = {f"liger_lab.hf.{other}" for other in HF_ORDER[:index]}
        assert imported <= below, f"{stem}.py imports {sorted(imported - below)}"


def repository_files() -> list[pathlib.Path]:
    """The repository's Python files (the aliases themselves aside) and the solution notebooks."""
    files = [
        path
        for folder in ("liger_lab", "tests", "benchmarks", "scripts")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if module_name(path) not in ALIASES
    ]
    return files + sorted((ROOT / "solutions").glob("*.ipynb"))


@pytest.mark.parametrize("path", repository_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_no_file_imports_an_old_path(path):
    package = package_of(module_name(path)) if path.is_relative_to(PACKAGE) else None
    old = sorted(imports(path, package) & set(ALIASES))
    assert not old, f"import {', '.join(ALIASES[name] for name in old)} instead of {', '.join(old)}"


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_path_is_its_new_module_and_says_why_it_is_kept(old):
    module = importlib.import_module(old)
    assert module is importlib.import_module(ALIASES[old]) or old == "liger_lab.patching"
    text = " ".join(ast.get_docstring(ast.parse(MODULES[old].read_text())).split())
    assert "old" in text and "new code imports" in text.lower(), f"{old}'s docstring: {text}"


def private_names_taken(path: pathlib.Path) -> list[str]:
    """The underscore names a file takes from another module of liger_lab: imported, or read off an imported
    module (``registry._UNFUSED``)."""
    tree = ast.parse(path.read_text())
    modules, taken = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").partition(".")[0] == "liger_lab":
            taken += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            modules |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.partition(".")[0] == "liger_lab"}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            taken.append(f"{node.value.id}.{node.attr}")
    return taken


@pytest.mark.parametrize("path", sorted((PACKAGE / "hf").glob("*.py")), ids=lambda path: path.name)
def test_the_hf_files_take_no_private_name_of_another_module(path):
    """What one file of the Hugging Face layer uses of another is that file's public surface."""
    assert private_names_taken(path) == []
