"""Rules of the code's shape, read from the source with `ast` (nothing is imported):
- outside megatron_armor/algorithms/, no code compares an algorithm's name with a string: callers ask the
  algorithm object what it needs;
- no function is longer than 60 lines unless its docstring gives the reason, as "(long: <why>)";
- the runtime classes that only copied a config section's fields (issue 28) do not come back: the component takes
  its section;
- no code compares a policy's or a server group's role with a string ("actor", "reference", ...): roles are objects
  (`launch/ray_job.SERVER_ROLES`, `algorithms.ACTOR` / `REFERENCE` / `TEACHER` policies) that say what they need.
"""

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "megatron_armor"
MAX_FUNCTION_LINES = 60
BUILTIN_NAMES = {"armor", "grpo", "grpo_kl", "mipu", "opd"}


@functools.cache
def _parsed() -> tuple[tuple[Path, ast.Module], ...]:
    """Every module of the package with its syntax tree, parsed once for all the checks."""
    return tuple((path, ast.parse(path.read_text(), filename=str(path))) for path in sorted(PACKAGE.rglob("*.py")))


def _sources(exclude: str | None = None):
    for path, tree in _parsed():
        if exclude is None or exclude not in path.relative_to(PACKAGE).parts:
            yield path, tree


def _mentions_algorithm_name(node: ast.AST) -> bool:
    """`<...algorithm...>.name` or a variable called algorithm_name / algo."""
    if isinstance(node, ast.Attribute) and node.attr == "name":
        return "algorithm" in ast.unparse(node.value) or "algo" == ast.unparse(node.value)
    return isinstance(node, ast.Name) and node.id in ("algorithm_name", "algo")


def _string_constants(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {c.value for c in node.elts if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return set()


def name_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing an algorithm's name with a string (==, !=, in, not in), or a built-in name with anything."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        by_attribute = any(_mentions_algorithm_name(o) for o in operands) and any(_string_constants(o) for o in operands)
        by_literal = any(_string_constants(o) & BUILTIN_NAMES for o in operands)
        if by_attribute or by_literal:
            lines.append(node.lineno)
    return lines


def long_functions(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, lines) of functions over MAX_FUNCTION_LINES whose docstring does not say "(long: ...)"."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and "(long: " not in (ast.get_docstring(node) or ""):
                out.append((node.name, length))
    return out


# Copy classes deleted because their component takes the config section itself -> what replaced them.
DELETED_COPY_CLASSES = {
    "OverlongPenalty": "SampleScorer takes the reward section (reward.overlong_*)",
    "UpdateGateConfig": "InferenceGapGate takes the mipu section (algorithms.GateSettings: the fields it reads)",
}  # trainer/run/warmstart.py's WarmStartConfig became the task.warm_start section (config.WarmStartConfig)


def from_config_classes(tree: ast.AST) -> set[str]:
    """The classes that define a `from_config` method."""
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            and any(isinstance(f, ast.FunctionDef) and f.name == "from_config" for f in node.body)}


ROLE_NAMES = {"actor", "ref", "reference", "teacher"}


def role_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing `role` (a name, or an attribute `.role`) or `role.name` with a role's name as a string."""
    def is_role(node: ast.AST) -> bool:
        target = node.value if isinstance(node, ast.Attribute) and node.attr == "name" else node
        return (isinstance(target, ast.Name) and target.id == "role") or (
            isinstance(target, ast.Attribute) and target.attr == "role")

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(is_role(o) for o in (node.left, *node.comparators))
            and any(_string_constants(o) & ROLE_NAMES for o in (node.left, *node.comparators))]


def defined_classes(tree: ast.AST) -> set[str]:
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def test_the_checks_catch_what_they_look_for():
    tree = ast.parse('if cfg.algorithm.name == "mipu":\n    pass\nif name in ("grpo_kl", "opd"):\n    pass\n'
                     'x = algorithm.name != other\nok = engine.name == "actor"\n')
    assert name_comparisons(tree) == [1, 3]
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(ast.parse(f"def f():\n{body}\n")) == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions(ast.parse(f'def f():\n    """(long: one table)"""\n{body}\n')) == []
    assert defined_classes(ast.parse("class A:\n    class B:\n        pass\n")) == {"A", "B"}
    assert role_comparisons(ast.parse('x = role == "reference"\ny = spec.role.name in ("actor",)\nz = role == "user"\n'
                                      'w = role is REFERENCE\n')) == [1, 2]
    assert from_config_classes(ast.parse("class A:\n    def from_config(cls): ...\nclass B:\n    pass\n")) == {"A"}


def test_no_code_outside_algorithms_compares_an_algorithm_name():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path, tree in _sources(exclude="algorithms")
             for line in name_comparisons(tree)]
    assert found == []


def test_functions_are_short_or_say_why_not():
    found = [f"{path.relative_to(PACKAGE.parent)}: {name} ({length} lines)" for path, tree in _sources()
             for name, length in long_functions(tree)]
    assert found == []


def test_deleted_copy_classes_do_not_come_back():
    found = [f"{path.relative_to(PACKAGE.parent)}: {name} ({DELETED_COPY_CLASSES[name]})" for path, tree in _sources()
             for name in sorted(defined_classes(tree) & DELETED_COPY_CLASSES.keys())]
    assert found == []


def test_no_class_has_a_from_config_adapter():
    """A component takes its config section as loaded (or a `load`/`build` of it, given the runtime objects); a value
    joined from several sections is joined where the run is built, or by the component that needs them all."""
    found = [f"{path.relative_to(PACKAGE.parent)}: {name}" for path, tree in _sources()
             for name in sorted(from_config_classes(tree))]
    assert found == [], "a component takes its config section; it needs no adapter"


def test_no_code_compares_a_role_with_a_string():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path, tree in _sources() for line in role_comparisons(tree)]
    assert found == []
