"""LoRA adapters of the in-process engine's HF model, kept beside its base weights and applied per call.

An adapter comes as Hugging Face PEFT's tensors (`base_model.model.<HF linear>.lora_A.weight` `[r, in]`,
`.lora_B.weight` `[out, r]`) and its `adapter_config.json` dict (`r`, `lora_alpha`): what SGLang's
/load_lora_adapter_from_tensors takes and `convert.peft_export` writes. A forward hook on each adapted
`nn.Linear` adds `(lora_alpha / r) B A x` to its output while the calling thread has that adapter selected
(`EngineAdapters.selected`): calls on other threads (the base's anchors beside the actor's rollouts) run with their
own choice, and with none selected the model is the base, bit for bit.

A routed expert's adapters come under the checkpoint's per-expert names (`<layer>.mlp.experts.<e>.gate_proj`, ...;
the family's `engine_expert` finds them in transformers 5's stacked experts module). Gate and up adapters act before
the expert's activation, so no output hook can add them: while an adapter with factors for a MoE layer is selected,
that layer's experts module runs `ExpertAdapters.forward` (transformers' expert loop with each expert's adapters
added to its gate, up and down products) instead of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_armor.models.families import model_family
from megatron_armor.models.families.weights import EngineExpert
from megatron_armor.models.tensors import checkpoint_tensors
from megatron_armor.utils.peft_files import PEFT_PREFIX

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


class ExpertAdapters:
    """One MoE layer's expert adapters, `LinearAdapter`s by (expert, projection: gate / up / down); an expert or
    projection without one computes as the base."""

    def __init__(self) -> None:
        self.factors: dict[tuple[int, str], LinearAdapter] = {}

    def forward(self, experts: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers 5's expert loop of `experts` (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) for tokens
        `hidden` [T, H] routed to experts `top_k_index` [T, k] with weights `top_k_weights` [T, k], each expert's
        adapters added to its gate, up and down products: [T, H]."""
        out = torch.zeros_like(hidden)
        for expert in top_k_index.unique().tolist():
            if expert >= experts.num_experts:  # transformers' mark of a slot routed to no local expert
                continue
            positions, tokens = torch.where((top_k_index == expert).T)  # transformers' order: by position, then token
            x = hidden[tokens]
            gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
            h = experts.act_fn(self._added(expert, "gate", gate, x)) * self._added(expert, "up", up, x)
            y = self._added(expert, "down", torch.nn.functional.linear(h, experts.down_proj[expert]), h)
            out.index_add_(0, tokens, (y * top_k_weights[tokens, positions, None]).to(out.dtype))
        return out

    def _added(self, expert: int, projection: str, product: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        factors = self.factors.get((expert, projection))
        return product if factors is None else product + factors.delta(x)


class EngineAdapters:
    """The adapters loaded into `model` by name (`load`, `unload`) and the hooks that apply the selected one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.family = model_family(model.config.model_type, source="the engine's model")
        # adapter name -> module name -> its factors (a linear layer's, or a MoE layer's experts module's)
        self.loaded: dict[str, dict[str, LinearAdapter | ExpertAdapters]] = {}
        self._hooked: set[str] = set()  # modules with the hook (or the experts' forward)
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
        if not factors:
            raise AdapterError(f"adapter {name!r} has no tensors")
        weights = self.family.engine_named_views(checkpoint_tensors(self.model))
        adapters: dict[str, LinearAdapter | ExpertAdapters] = {}
        for module, pair in factors.items():
            expert = self.family.engine_expert(module)
            adapter = self._checked(name, module, weights.get(f"{module}.weight"), expert is None, pair, rank,
                                    alpha / rank, convert)
            if expert is None:
                adapters[module] = adapter
            else:
                self._check_experts(name, expert)
                experts = adapters.setdefault(expert.module, ExpertAdapters())
                experts.factors[expert.expert, expert.projection] = adapter
        for module, adapter in adapters.items():
            if module not in self._hooked:
                self._hook(module, isinstance(adapter, ExpertAdapters))
        self.loaded[name] = adapters

    def _checked(self, name: str, module: str, weight: torch.Tensor | None, linear: bool, pair: dict[str, torch.Tensor],
                 rank: int, scale: float, convert: Callable[[torch.Tensor], torch.Tensor] | None) -> LinearAdapter:
        """`module`'s factors as the model's layer of weight `weight` [out, in] (by the checkpoint's name: a view
        into the stacked experts for a routed expert's projection, else `linear`: an `nn.Linear`'s) takes them, or
        AdapterError."""
        if weight is None:
            raise AdapterError(f"adapter {name!r}: the model has no layer {module!r}")
        if linear and not isinstance(layer := self.model.get_submodule(module), torch.nn.Linear):
            raise AdapterError(f"adapter {name!r}: {module} is a {type(layer).__name__}, not a linear layer")
        if pair.keys() != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {module} needs lora_A and lora_B, got {sorted(pair)}")
        out_features, in_features = weight.shape
        want = {"A": (rank, in_features), "B": (out_features, rank)}
        for factor, tensor in pair.items():
            if tuple(tensor.shape) != want[factor]:
                raise AdapterError(f"adapter {name!r}: {module}.lora_{factor} has shape {tuple(tensor.shape)}, the "
                                   f"layer needs {want[factor]} (r {rank})")
        a, b = ((t.detach() if convert is None else convert(t.detach())).to(
            device=weight.device, dtype=weight.dtype, copy=True) for t in (pair["A"], pair["B"]))
        return LinearAdapter(a, b, scale)

    def _check_experts(self, name: str, expert: EngineExpert) -> None:
        """AdapterError unless `expert.module` is an experts module whose loop `ExpertAdapters.forward` repeats:
        gate and up fused in that order, untransposed, without biases."""
        experts = self.model.get_submodule(expert.module)
        layout = {key: getattr(experts, key, None) for key in ("has_gate", "is_concatenated", "is_transposed",
                                                                  "has_bias")}
        if layout != {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False}:
            raise AdapterError(f"adapter {name!r}: the experts of {expert.module} ({type(experts).__name__}, {layout}) "
                               f"are not laid out as the expert adapters' loop needs")

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

    def _factors(self, module: str) -> LinearAdapter | ExpertAdapters | None:
        """The calling thread's selected adapter's factors of `module`, or None (none selected, or none there)."""
        adapter = getattr(self._thread, "adapter", None)
        return None if adapter is None else adapter.get(module)

    def _hook(self, module: str, experts: bool) -> None:
        """Make `module` apply the selected adapter: a linear layer through a forward hook, a MoE layer's experts
        module through its forward (an instance attribute over the class's; its parameters and names stay)."""
        layer = self.model.get_submodule(module)
        self._hooked.add(module)
        if not experts:
            def add_delta(_: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
                factors = self._factors(module)
                return None if factors is None else output + factors.delta(args[0])

            layer.register_forward_hook(add_delta)
            return
        base_forward = layer.forward

        def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            factors = self._factors(module)
            if factors is None:
                return base_forward(hidden, top_k_index, top_k_weights)
            return factors.forward(layer, hidden, top_k_index, top_k_weights)

        layer.forward = forward


def _module_and_factor(key: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "A"); AdapterError for another name."""
    for factor, suffix in FACTOR_SUFFIXES.items():
        if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
            return key[len(PEFT_PREFIX):-len(suffix)], factor
    raise AdapterError(f"{key!r} is not a PEFT LoRA tensor name ({PEFT_PREFIX}<layer>.lora_A.weight / .lora_B.weight)")
