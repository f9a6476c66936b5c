"""Save and load a tree of Megatron sharded objects with Megatron's distributed checkpointing (torch_dist
backend; gloo on CPU): each rank writes only its shards, a load reads only the slices this rank needs.

Only the tree's sharded leaves (`ShardedTensor`, `ShardedTensorFactory`, `ShardedObject`) go to disk; its
other leaves are the caller's (e.g. an optimizer's param groups) and a load hands back the caller's own,
so a checkpoint never depends on how the saving run's optimizer structured its state dict. Lists are saved
as dicts keyed by position.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.validation import StrictHandling

from megatron_armor.convert.megatron_checkpoint import collect_write_results_in_process


def plan_save(tree: Any, directory: Path) -> AsyncRequest:
    """Plan the save of `tree`'s sharded leaves into `directory` (collective: the ranks agree who writes
    what; a tensor replicated over data-parallel (and context-parallel) ranks is written by one of them, Megatron's
    fully parallel save spreading those writes evenly over the DP x CP group) and return Megatron's request: `async_fn` writes
    this rank's shards (no collective), its `finalize_fns` (collective) write the global metadata once every
    rank wrote."""
    collect_write_results_in_process()
    strategy = FullyParallelSaveStrategyWrapper(
        TorchDistSaveShardedStrategy(), parallel_state.get_data_parallel_group(with_context_parallel=True))
    return dist_checkpointing.save(_sharded_only(tree) or {}, str(directory), sharded_strategy=strategy,
                                   async_sharded_save=True, async_strategy="mcore")


def start_write(request: AsyncRequest, *, background: bool) -> Callable[[], None]:
    """Write this rank's shards of a `plan_save` request, now or (`background`) in a thread; returns the
    function that waits for the write (re-raising its error). The shards are staged to host memory first
    (Megatron's `preload_fn`), in the background as copies (training goes on changing the live tensors); the
    thread does file I/O only, no collective, so it runs beside the training's collectives."""
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        unstaged = {id(t) for *_, (_, tensors) in args[1] for _, t in tensors}
        args[1] = _copies(request.preload_fn(), originals=unstaged) if background else request.preload_fn()
    failure: list[BaseException] = []

    def write() -> None:
        try:
            if request.async_fn is not None:
                request.async_fn(*args, **request.async_fn_kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            failure.append(error)

    thread = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
    if background:
        thread.start()
    else:
        write()

    def wait() -> None:
        if background:
            thread.join()
        if failure:
            raise RuntimeError(f"the checkpoint shard write failed: {failure[0]}") from failure[0]

    return wait


def _copies(buckets: list, *, originals: set[int]) -> list:
    """Megatron's staged write buckets with the tensors it did not copy copied (its staging copies GPU tensors to
    the host and leaves host tensors, the live ones, as they are); `originals`: ids of the unstaged tensors."""
    return [(file_name, key, (data, [(item, tensor.clone() if id(tensor) in originals else tensor)
                                     for item, tensor in tensors]))
            for file_name, key, (data, tensors) in buckets]


def load_tree(request: Any, directory: Path) -> Any:
    """`request` with its sharded leaves replaced by the values saved in `directory` (resharded to this
    rank's shards; collective); its other leaves stay the request's. Keys saved but not requested are
    ignored (e.g. a distributed optimizer's extra state), requested keys missing from it raise."""
    sharded = _sharded_only(request)
    if sharded is None:
        return request
    loaded = dist_checkpointing.load(sharded, str(directory), strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    return _fill(request, loaded)


def saved_tensor_keys(directory: Path) -> set[str]:
    """The keys of the tensors saved in `directory` (read from its metadata; no tensor is loaded)."""
    return set(dist_checkpointing.load_tensors_metadata(str(directory)))


def _children(tree: Any) -> list[tuple[Any, Any]]:
    if isinstance(tree, dict):
        return list(tree.items())
    if isinstance(tree, (list, tuple)):
        return list(enumerate(tree))
    return []


def _sharded_only(tree: Any) -> Any:
    """The sharded leaves of `tree` in nested dicts (lists become dicts keyed by position); None: none."""
    if isinstance(tree, ShardedBase):
        return tree
    kept = {key: _sharded_only(value) for key, value in _children(tree)}
    kept = {key: value for key, value in kept.items() if value is not None}
    return kept or None


def _fill(request: Any, loaded: Any) -> Any:
    """`request` with each sharded leaf replaced by the value at its position in `loaded`, never the live tensor
    the leaf was built on (Megatron loads into it in place; a copy keeps the loaded value when the module whose
    live tensor it is gets written by another's restore, e.g. an optimizer's master weights, views of it)."""
    if isinstance(request, ShardedBase):
        live = getattr(request, "data", None)
        aliased = torch.is_tensor(loaded) and torch.is_tensor(live) and loaded.data_ptr() == live.data_ptr()
        return loaded.clone() if aliased else loaded
    if isinstance(request, LocalNonpersistentObject):  # a value of this rank's that Megatron never saves
        return request.unwrap()
    if not _children(request):
        return request
    loaded = loaded if isinstance(loaded, dict) else {}
    filled = [(key, _fill(value, loaded.get(key))) for key, value in _children(request)]
    return dict(filled) if isinstance(request, dict) else type(request)(value for _, value in filled)

