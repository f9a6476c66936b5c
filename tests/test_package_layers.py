"""The package graph of megatron_armor is layered and free of cycles (docs/architecture.md, "Layers").

Every module's import statements are read with `ast` (nothing is imported), those inside functions and
`if TYPE_CHECKING:` blocks included. A package may import from lower layers and from packages of its
own layer as long as no cycle forms, never from a higher layer; modules form no cycle either (within a
package too). An import counts as an edge to the module it names: `from a.b import c` is `a.b.c` when
that is a module, else `a.b`; parent packages' `__init__` files, which Python runs first, are not counted.
Inside `trainer` its sub-packages are layered the same way (`TRAINER_LAYERS`, bottom to top): a sub-package imports
lower sub-packages, never higher ones, and a new one is placed there deliberately.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = "megatron_armor"

# Bottom to top. A package is a directory under megatron_armor/ or a module directly in it (cli.py);
# "megatron_armor" is the top-level __init__.py. A new package must be placed here deliberately.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("megatron_armor", "utils", "config", "data", "rewards"),
    ("algorithms", "models", "kernels", "distributed", "monitor"),
    ("rollout", "convert", "scoring", "planning"),
    ("teacher", "diagnostics", "evaluation", "agentic"),
    ("trainer",),
    ("launch", "cli", "__main__"),
)

TRAINER = f"{TOP}.trainer"
# The trainer's sub-packages, bottom to top, one to a layer: each imports only those below it. A module directly in
# trainer/ counts as a sub-package. A new one must be placed here deliberately.
TRAINER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("step_inputs",),  # StepPlan, PolicyHandles: what every phase of the RL step reads
    ("colocation",),  # the GPU shared with colocated servers, an engine shared by two policies, weight pushes
    ("rollouts",),  # a step's samples: generated, scored, grouped, and when (rollout.mode)
    ("update",),  # advantages, logprobs, optimizer steps, and what undoes them (faults, MIPU gate, snapshot)
    ("checkpointing",),  # the trainer's state on disk
    ("step",),  # RLTrainer: the RL step's phases and the state a resumed run needs
    ("guard",),  # the collapse monitor and its anchor action in the run loop
    ("run",),  # set-up from the config and the run loop of `armor train`
)


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    file: str  # importing file, relative to the repository root
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.source} -> {self.target}"


def module_files(root: Path = ROOT, top: str = TOP) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root/top` (a package is its __init__.py)."""
    modules = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(source: str, path: Path, code: str, modules: Iterable[str], root: Path = ROOT, top: str = TOP) -> list[Import]:
    """The imports of package modules in `code` (module `source`, file `path`), anywhere in the file."""
    modules = set(modules)
    is_package = path.name == "__init__.py"

    def resolve(name: str) -> str | None:  # the longest prefix of `name` that is a module
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    found = []
    for node in ast.walk(ast.parse(code, filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = source.split(".") if is_package else source.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            if name != top and not name.startswith(top + "."):
                continue
            target = resolve(name)
            edge = Import(source, target, path.relative_to(root).as_posix(), node.lineno) if target else None
            if edge is not None and target != source and edge not in found:
                found.append(edge)
    return found


def package_imports(root: Path = ROOT, top: str = TOP) -> list[Import]:
    modules = module_files(root, top)
    return [edge for name, path in modules.items() for edge in imports_of(name, path, path.read_text(), modules, root, top)]


def package_of(module: str, within: str = TOP) -> str:
    """The package of `module` directly under `within` (`within`'s last name for `within` itself). Under
    megatron_armor: megatron_armor.trainer.run.train -> trainer; megatron_armor.cli -> cli; megatron_armor ->
    megatron_armor. Under megatron_armor.trainer: megatron_armor.trainer.run.train -> run."""
    parts = module.split(".")
    depth = within.count(".") + 1
    return parts[depth] if len(parts) > depth else parts[-1]


def imports_within(imports: Iterable[Import], package: str) -> list[Import]:
    """The imports both of whose ends are modules of `package` (dotted)."""
    def inside(module: str) -> bool:
        return module == package or module.startswith(package + ".")

    return [edge for edge in imports if inside(edge.source) and inside(edge.target)]


def _cycles(edges: Mapping[str, Mapping[str, Import]]) -> list[tuple[list[Import], list[Import]]]:
    """Per strongly connected component of more than one node (Tarjan): a shortest cycle through its first
    node, and every edge inside the component (breaking the component needs some of them gone)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)

    cycles = []
    for component in components:
        start = min(component)
        # breadth-first from `start` inside the component back to `start`: a shortest cycle through it
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            following = []
            for node in frontier:
                for succ in sorted(edges.get(node, {})):
                    if succ in component and succ not in parent:
                        parent[succ] = node
                        following.append(succ)
            frontier = following
        path, node = [], start
        while True:
            path.append(edges[parent[node]][node])
            node = parent[node]
            if node == start:
                break
        inside = [edge for node in sorted(component) for succ, edge in sorted(edges.get(node, {}).items())
                  if succ in component]
        cycles.append((path[::-1], inside))
    return cycles


def layer_problems(
    imports: Sequence[Import], layers: Sequence[Sequence[str]] = LAYERS, *, within: str = TOP, table: str = "LAYERS",
) -> list[str]:
    """Every breach by `imports` of `layers` (the table named `table`), which layers the packages directly under
    `within`: unplaced packages, upward imports, package and module cycles."""
    layer_of = {package: level for level, packages in enumerate(layers) for package in packages}
    packages = {module: package_of(module, within) for edge in imports for module in (edge.source, edge.target)}
    problems = []
    for package in sorted(set(packages.values()) - layer_of.keys()):
        where = next(e for e in imports if package in (packages[e.source], packages[e.target]))
        problems.append(f"package {package!r} is in no layer of {table} (tests/test_package_layers.py): place it "
                        f"deliberately (seen at {where})")
    package_edges: dict[str, dict[str, Import]] = {}
    module_edges: dict[str, dict[str, Import]] = {}
    for edge in imports:
        source, target = packages[edge.source], packages[edge.target]
        module_edges.setdefault(edge.source, {}).setdefault(edge.target, edge)
        if source == target:
            continue
        package_edges.setdefault(source, {}).setdefault(target, edge)
        if source in layer_of and target in layer_of and layer_of[target] > layer_of[source]:
            problems.append(f"upward import: {edge} ({source}, layer {layer_of[source]}, imports {target}, "
                            f"layer {layer_of[target]})")
    for cycle, inside in _cycles(package_edges):
        names = " -> ".join([packages[cycle[0].source]] + [packages[e.target] for e in cycle])
        problems.append(f"package cycle {names}; imports between the packages of the cycle (one each):\n    "
                        + "\n    ".join(map(str, inside)))
    for cycle, inside in _cycles(module_edges):
        names = " -> ".join([cycle[0].source] + [e.target for e in cycle])
        problems.append(f"module cycle {names}; imports between the modules of the cycle:\n    "
                        + "\n    ".join(map(str, inside)))
    return problems


def test_packages_import_only_lower_layers_without_cycles():
    imports = package_imports()
    assert len(imports) > 100  # the reader sees the package's imports
    problems = layer_problems(imports)
    assert not problems, "\n".join(problems)


def test_every_package_is_in_the_layer_table():
    packages = {package_of(name) for name in module_files()}
    placed = {package for layer in LAYERS for package in layer}
    assert packages <= placed, f"packages in no layer: {sorted(packages - placed)}"
    assert len(placed) == sum(map(len, LAYERS)), "a package is in two layers"


def test_trainer_subpackages_import_only_lower_layers_without_cycles():
    imports = imports_within(package_imports(), TRAINER)
    assert len(imports) > 50  # the reader sees the trainer's imports
    problems = layer_problems(imports, TRAINER_LAYERS, within=TRAINER, table="TRAINER_LAYERS")
    assert not problems, "\n".join(problems)


def test_every_trainer_subpackage_is_in_its_layer_table():
    subpackages = {package_of(name, TRAINER) for name in module_files() if name.startswith(TRAINER + ".")}
    placed = [package for layer in TRAINER_LAYERS for package in layer]
    assert subpackages == set(placed), f"in no layer: {sorted(subpackages - set(placed))}, " \
                                       f"placed but absent: {sorted(set(placed) - subpackages)}"
    assert len(placed) == len(set(placed)), "a sub-package is in two layers"


def _fake(tmp_path: Path, files: dict[str, str]) -> list[Import]:
    for name, code in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    return package_imports(tmp_path, "pkg")


def test_checker_finds_upward_imports_cycles_and_unplaced_packages(tmp_path):
    imports = _fake(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "def f():\n    from pkg.high import b\n",  # upward, lazy: still an edge
        "pkg/low/c.py": "from . import d\n",  # relative: c -> d -> c
        "pkg/low/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.low.c\n",
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from pkg.low.a import f\nimport os\n",
        "pkg/stray.py": "from pkg.low import a\n",
    })
    assert {(e.source, e.target, e.line) for e in imports} == {
        ("pkg.low.a", "pkg.high.b", 2), ("pkg.low.c", "pkg.low.d", 1), ("pkg.low.d", "pkg.low.c", 3),
        ("pkg.high.b", "pkg.low.a", 1), ("pkg.stray", "pkg.low.a", 1),
    }
    problems = layer_problems(imports, layers=(("low",), ("high",)))
    assert any(p.startswith("package 'stray' is in no layer") for p in problems)
    assert "upward import: pkg/low/a.py:2: pkg.low.a -> pkg.high.b (low, layer 0, imports high, layer 1)" in problems
    assert any(p.startswith("package cycle high -> low -> high;") and "pkg/high/b.py:1" in p for p in problems)
    module_cycles = [p for p in problems if p.startswith("module cycle")]
    assert len(module_cycles) == 2  # a <-> b across packages, c <-> d within one
    assert any("pkg/low/c.py:1: pkg.low.c -> pkg.low.d" in p and "pkg/low/d.py:3" in p for p in module_cycles)
    # in one layer the two packages may import each other's modules, but still not in a cycle
    problems = layer_problems(imports, layers=(("low", "high", "stray"),))
    assert [p.split(";")[0] for p in problems] == [
        "package cycle high -> low -> high", "module cycle pkg.high.b -> pkg.low.a -> pkg.high.b",
        "module cycle pkg.low.c -> pkg.low.d -> pkg.low.c",
    ]


def test_checker_layers_the_subpackages_of_a_package(tmp_path):
    imports = _fake(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/core/__init__.py": "",
        "pkg/core/low/__init__.py": "",
        "pkg/core/low/a.py": "from pkg.core.high import b\n",  # upward inside core
        "pkg/core/high/__init__.py": "",
        "pkg/core/high/b.py": "from pkg import util\n",  # leaves core: the top-level table's concern
        "pkg/core/c.py": "from pkg.core.low import a\n",  # a module directly in core counts as a sub-package
        "pkg/util.py": "",
    })
    inside = imports_within(imports, "pkg.core")
    assert {(e.source, e.target) for e in inside} == {("pkg.core.low.a", "pkg.core.high.b"),
                                                      ("pkg.core.c", "pkg.core.low.a")}
    problems = layer_problems(inside, layers=(("low",), ("high",)), within="pkg.core", table="CORE_LAYERS")
    assert problems == [
        "package 'c' is in no layer of CORE_LAYERS (tests/test_package_layers.py): place it deliberately "
        "(seen at pkg/core/c.py:1: pkg.core.c -> pkg.core.low.a)",
        "upward import: pkg/core/low/a.py:1: pkg.core.low.a -> pkg.core.high.b (low, layer 0, imports high, layer 1)",
    ]
    assert layer_problems(inside, layers=(("high",), ("low",), ("c",)), within="pkg.core") == []


def test_checker_accepts_a_layered_acyclic_graph(tmp_path):
    imports = _fake(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/base.py": "import json\n",
        "pkg/mid/__init__.py": "",
        "pkg/mid/x.py": "from pkg import base\nfrom pkg.mid import y\n",
        "pkg/mid/y.py": "import pkg.base\n",
        "pkg/cli.py": "from pkg.mid.x import *\n",
    })
    assert layer_problems(imports, layers=(("base",), ("mid",), ("cli",))) == []
