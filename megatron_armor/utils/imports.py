"""Objects named by a dotted path, `package.module:attribute` (reward functions, plug-in algorithms)."""

from __future__ import annotations

import importlib
from typing import Any


def import_attribute(path: str, kind: str, form: str = "package.module:attribute") -> Any:
    """Import the module of `path` and return its attribute; a ValueError naming `kind` (what the path is
    for, e.g. "reward function") and the expected `form` when the path is malformed or does not resolve."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{kind} {path!r} must look like {form!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{kind} {path!r}: cannot import module {module_name!r} ({error})") from error
    value = getattr(module, attr, None)
    if value is None:
        raise ValueError(f"{kind} {path!r}: module {module_name!r} has no attribute {attr!r}")
    return value
