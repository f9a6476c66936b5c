"""Comparison of state-dict trees (nested dicts, lists and tuples of tensors and plain values) for tests."""

import torch


def bit_identical(a, b) -> bool:
    """Whether two state-dict trees have the same structure, dtypes and bits."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bit_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(bit_identical(x, y) for x, y in zip(a, b))
    return a == b


def saved_state(checkpoint) -> dict:
    """Everything a trainer checkpoint's Megatron distributed checkpoint (`<checkpoint>/state`) holds, read in
    this process without a process group: {global key: full tensor} for the tensors (e.g.
    "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight", layers stacked) and {key/shard_...: object}
    for the objects (RNG states, the subspace constraint's state per (PP, TP) position)."""
    import tempfile
    from pathlib import Path

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(str(Path(checkpoint) / "state"), f"{scratch}/state.pt")
        saved = torch.load(f"{scratch}/state.pt", weights_only=False)
    return {key: value[0] if isinstance(value, list) else value for key, value in saved.items()}  # objects: [obj]


def saved_modules(checkpoint) -> dict:
    """`saved_state` grouped by module: {"actor": the actor's tensors, "optimizer": the optimizer's entries
    (Adam moments per parameter, "adam_step"), "ref": the reference's tensors (when saved), "subspace": ...}."""
    groups: dict = {}
    for key, value in saved_state(checkpoint).items():
        name, _, shard = key.partition("/shard_")
        if name.startswith("optimizer."):
            groups.setdefault("optimizer", {})["adam_step" if name == "optimizer.adam_step" else name] = value
        elif name.startswith("ref."):
            groups.setdefault("ref", {})[name.removeprefix("ref.")] = value
        elif name.endswith(".state") and shard:  # a layout-bound module, one object per (PP, TP) position
            groups.setdefault(name.removesuffix(".state"), {})[shard] = value
        elif not shard and name != "common_state":
            groups.setdefault("actor", {})[name] = value
    return groups


def full_weight(actor: dict, name: str) -> torch.Tensor:
    """Parameter `name` of a model ("decoder.layers.<i>.<rest>" or any other name), whole, from `saved_modules`'s
    actor (or reference), whose layers are stacked under "decoder.layers.<rest>" (a SwiGLU fc1 with its gate and
    up halves on an axis of their own: reshape to the parameter's shape)."""
    import re

    layer = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    return actor[f"decoder.layers.{layer[2]}"][int(layer[1])] if layer else actor[name]


def adam_moments(model, optimizer) -> dict:
    """{parameter name: (exp_avg, exp_avg_sq)} of every trained parameter of a one-process `model` (its bare module)
    under its plain Megatron optimizer (whose torch optimizers step the parameters themselves: fp32), copied."""
    from megatron_armor.trainer.update.optimizer import torch_optimizers

    states = {param: state for inner in torch_optimizers(optimizer) for param, state in inner.state.items()}
    return {name: (states[param]["exp_avg"].clone(), states[param]["exp_avg_sq"].clone())
            for name, param in model.named_parameters() if param.requires_grad}
