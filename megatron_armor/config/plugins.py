"""Objects named by a path: `package.module:attribute` or `path/to/file.py:attribute` (reward functions,
plug-in algorithms)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def import_attribute(path: str, kind: str, form: str = "package.module:attribute") -> Any:
    """Import the module of `path` and return its attribute; a ValueError naming `kind` (what the path is
    for, e.g. "reward function") and the expected `form` when the path is malformed or does not resolve.

    The module is a dotted module name (importable from sys.path) or, when it ends in `.py`, a Python file
    (relative to the working directory), loaded once per resolved path as verl's custom_reward_function.path.
    """
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{kind} {path!r} must look like {form!r} or 'path/to/file.py:attribute'")
    module = _load_file(module_name, kind, path) if module_name.endswith(".py") else _import(module_name, kind, path)
    value = getattr(module, attr, None)
    if value is None:
        raise ValueError(f"{kind} {path!r}: module {module_name!r} has no attribute {attr!r}")
    return value


def _import(module_name: str, kind: str, path: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{kind} {path!r}: cannot import module {module_name!r} ({error})") from error


def _load_file(file_name: str, kind: str, path: str) -> ModuleType:
    """The module of the Python file `file_name`, executed once per process (cached in sys.modules under a
    name derived from its resolved path)."""
    file = Path(file_name).resolve()
    if not file.is_file():
        raise ValueError(f"{kind} {path!r}: no file {file} (a relative path is taken from the working directory "
                         f"{Path.cwd()})")
    name = f"_armor_file_{file.stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise ValueError(f"{kind} {path!r}: executing {file} failed ({type(error).__name__}: {error})") from error
    return module
