"""Model families by `model_type`: the built-ins register themselves on import (`models.families`), and so can a
user's (`register_family`) before the model is loaded."""

from __future__ import annotations

import difflib

from megatron_armor.models.families.base import ModelConfigError, ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` buildable (config.json `model_type: <family.model_type>`); a ValueError if another family has
    its model_type or claims one of its known shapes' names."""
    if _FAMILIES.get(family.model_type, family) is not family:
        raise ValueError(f"model family {family.model_type!r} is already registered")
    claimed = {name: other.model_type for other in _FAMILIES.values() if other is not family
               for name in other.known_shapes}
    taken = sorted(name for name in family.known_shapes if name in claimed)
    if taken:
        raise ValueError(f"model family {family.model_type!r}: known shapes {taken} are already "
                         f"{[claimed[name] for name in taken]}'s")
    _FAMILIES[family.model_type] = family
    return family


def registered_families() -> list[str]:
    """Registered model types, in registration order."""
    return list(_FAMILIES)


def model_family(model_type: str | None, *, source: str = "config") -> ModelFamily:
    """The family registered for `model_type`; a ModelConfigError naming the registered ones otherwise."""
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]
    close = difflib.get_close_matches(str(model_type), list(_FAMILIES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ModelConfigError(f"{source}: model_type {model_type!r} is not supported; supported: "
                           f"{registered_families()}{hint}")


def known_shapes() -> dict[str, dict]:
    """name -> config.json fields (model_type included) of every registered family's known public models."""
    return {name: {"model_type": family.model_type, **fields}
            for family in _FAMILIES.values() for name, fields in family.known_shapes.items()}


def unregister_family(model_type: str) -> None:
    """Forget the family registered as `model_type` (KeyError if none is)."""
    del _FAMILIES[model_type]
