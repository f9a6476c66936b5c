"""LoRA adapters of the in-process engine's HF model, kept beside its base weights and applied per call.

An adapter comes as Hugging Face PEFT's tensors (`base_model.model.<HF linear>.lora_A.weight` `[r, in]`,
`.lora_B.weight` `[out, r]`) and its `adapter_config.json` dict (`r`, `lora_alpha`): what SGLang's
/load_lora_adapter_from_tensors takes and `convert.peft_export` writes. A forward hook on each adapted
`nn.Linear` adds `(lora_alpha / r) B A x` to its output while the calling thread has that adapter selected
(`EngineAdapters.selected`): calls on other threads (the base's anchors beside the actor's rollouts) run with their
own choice, and with none selected the model is the base, bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the wrapped HF model's names
FACTOR_SUFFIXES = {"A": ".lora_A.weight", "B": ".lora_B.weight"}


class AdapterError(ValueError):
    """An adapter the model cannot take (names, shapes, config), or a name no adapter has."""


@dataclass(frozen=True)
class LinearAdapter:
    """One linear layer's adapter: `a` `[r, in]`, `b` `[out, r]` (the layer's dtype and device) and `scale`."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """`scale * B A x` for the layer's input x `[..., in]`: `[..., out]` (the trainer's order of products)."""
        return torch.nn.functional.linear(torch.nn.functional.linear(x, self.a), self.b) * self.scale


class EngineAdapters:
    """The adapters loaded into `model` by name (`load`, `unload`) and the hooks that apply the selected one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded: dict[str, dict[str, LinearAdapter]] = {}  # adapter name -> HF module name -> its factors
        self._hooked: set[str] = set()  # modules with the hook
        self._thread = threading.local()  # .adapter: the calling thread's selected adapter (module -> factors)

    def load(self, name: str, config: dict, named_tensors: Iterable[tuple[str, torch.Tensor]],
             convert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Load (or replace) adapter `name` from PEFT-named tensors and PEFT's config dict; `convert` maps each factor
        before it is stored (the engine's weight precision). Everything is checked before anything changes
        (AdapterError)."""
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
            raise AdapterError(f"adapter {name!r}: config_dict needs r (an int >= 1) and lora_alpha, got r={rank!r}, "
                               f"lora_alpha={alpha!r}")
        if config.get("use_rslora") or config.get("use_dora"):
            raise AdapterError(f"adapter {name!r}: rsLoRA and DoRA adapters are not supported")
        factors: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in named_tensors:
            module, factor = _module_and_factor(key)
            factors.setdefault(module, {})[factor] = tensor
        adapters = {module: self._checked(name, module, pair, rank, alpha / rank, convert)
                    for module, pair in factors.items()}
        if not adapters:
            raise AdapterError(f"adapter {name!r} has no tensors")
        for module in adapters.keys() - self._hooked:
            self.model.get_submodule(module).register_forward_hook(self._hook(module))
            self._hooked.add(module)
        self.loaded[name] = adapters

    def _checked(self, name: str, module: str, pair: dict[str, torch.Tensor], rank: int, scale: float,
                 convert: Callable[[torch.Tensor], torch.Tensor] | None) -> LinearAdapter:
        """`module`'s factors as the model's linear layer takes them, or AdapterError."""
        try:
            layer = self.model.get_submodule(module)
        except AttributeError:
            raise AdapterError(f"adapter {name!r}: the model has no layer {module!r}") from None
        if not isinstance(layer, torch.nn.Linear):
            raise AdapterError(f"adapter {name!r}: {module} is a {type(layer).__name__}, not a linear layer")
        if pair.keys() != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {module} needs lora_A and lora_B, got {sorted(pair)}")
        a, b = pair["A"], pair["B"]
        want = {"A": (rank, layer.in_features), "B": (layer.out_features, rank)}
        for factor, tensor in pair.items():
            if tuple(tensor.shape) != want[factor]:
                raise AdapterError(f"adapter {name!r}: {module}.lora_{factor} has shape {tuple(tensor.shape)}, the "
                                   f"layer needs {want[factor]} (r {rank})")
        weight = layer.weight
        a, b = ((t.detach() if convert is None else convert(t.detach())).to(
            device=weight.device, dtype=weight.dtype, copy=True) for t in (a, b))
        return LinearAdapter(a, b, scale)

    def unload(self, name: str) -> None:
        """Drop adapter `name` (its hooks stay and do nothing for it)."""
        if self.loaded.pop(name, None) is None:
            raise AdapterError(f"no adapter {name!r} is loaded (loaded: {sorted(self.loaded)})")

    @contextlib.contextmanager
    def selected(self, name: str | None) -> Iterator[None]:
        """Inside, this thread's forward passes apply adapter `name` (None: none, the base)."""
        if name is not None and name not in self.loaded:
            raise AdapterError(f"no adapter {name!r} is loaded (loaded: {sorted(self.loaded)})")
        previous = getattr(self._thread, "adapter", None)
        self._thread.adapter = None if name is None else self.loaded[name]
        try:
            yield
        finally:
            self._thread.adapter = previous

    def _hook(self, module: str):
        def add_delta(layer: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            adapter = getattr(self._thread, "adapter", None)
            factors = None if adapter is None else adapter.get(module)
            return None if factors is None else output + factors.delta(args[0])

        return add_delta


def _module_and_factor(key: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "A"); AdapterError for another name."""
    for factor, suffix in FACTOR_SUFFIXES.items():
        if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
            return key[len(PEFT_PREFIX):-len(suffix)], factor
    raise AdapterError(f"{key!r} is not a PEFT LoRA tensor name ({PEFT_PREFIX}<layer>.lora_A.weight / .lora_B.weight)")
