"""How a section builds its component: `section.build(**runtime_objects)`.

A section is its component's settings (the optimizer's, the logger's, the rollout engines', ...), and `build` makes
the component from it and the runtime objects the component needs besides (a model, engines, a tokenizer, a run
directory), as torchtitan's component configs do. `config` is the bottom layer, though: loading a config and `--help`
import no torch, and no section imports what it builds. So the dependency is inverted: the component's module
registers its constructor for the section's class (`@builds(LoggingConfig)` on `MetricsLogger`), and
`Buildable.build` calls what was registered. A section names its component (`component`, "module:attribute") for
its error when that module was never imported and for the configuration reference; a test checks that the name and
the registration agree, and that importing the run's entry point (`trainer/run/train.py`) registers every builder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

Builder = TypeVar("Builder", bound=Callable[..., Any])

_BUILDERS: dict[type, Callable[..., Any]] = {}


def builds(section: type[Buildable]) -> Callable[[Builder], Builder]:
    """Register the decorated class or function as what `section` builds: `section_instance.build(**runtime)` calls
    it as `builder(section_instance, **runtime)`. One builder per section class (a second one is a ValueError)."""

    def register(builder: Builder) -> Builder:
        held = _BUILDERS.setdefault(section, builder)
        if held is not builder:
            raise ValueError(f"{section.__qualname__} already builds {_qualified(held)}; it cannot also build "
                             f"{_qualified(builder)}")
        return builder

    return register


def builder_of(section: type[Buildable]) -> Callable[..., Any] | None:
    """What `section` builds, or None while its component's module is not imported."""
    return _BUILDERS.get(section)


class Buildable:
    """A section that builds its component (`build`). `component` names it, "package.module:attribute"."""

    component: ClassVar[str]

    def build(self, **runtime: Any) -> Any:
        """The component as this section says, made with the `runtime` objects it needs besides (see the
        component's constructor: `component`)."""
        builder = _BUILDERS.get(type(self))
        if builder is None:
            module = self.component.partition(":")[0]
            raise LookupError(f"{type(self).__qualname__}.build: its component {self.component} is not registered; "
                              f"import {module} first (it registers itself with @builds({type(self).__qualname__}))")
        return builder(self, **runtime)


def _qualified(builder: Callable[..., Any]) -> str:
    return f"{builder.__module__}:{builder.__qualname__}"
