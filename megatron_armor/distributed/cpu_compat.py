"""Adapters that let unmodified Megatron-Core run on CPU-only machines (gloo backend).

Megatron-Core assumes CUDA in a few places that are not on the math path. On a machine without a
GPU, `enable_cpu_compat()` installs adaptations 2-4 below process-wide and `megatron_device_scope()`
adds adaptation 1 around calls into Megatron (schedules, DDP construction), so the rest of the
program (e.g. the in-process rollout engine) pays no per-call overhead. With CUDA both do nothing,
so GPU runs use Megatron exactly as shipped.

Adaptations (megatron-core 0.19):
1. Tensor factories called with `device="cuda"` (pipeline schedules allocate loss/num-token
   accumulators and p2p receive buffers that way; the grad buffer allocates its warm-up tensor so)
   are redirected to CPU by a `TorchFunctionMode`, which also makes `Tensor.cuda()` return the
   tensor itself (a GPTModel with tied embeddings under pipeline parallelism moves its output-layer
   copy to CUDA before all-reducing it with the embedding). In the same mode `Tensor.type()` (no
   arguments) names a CPU tensor by its CUDA type, e.g. 'torch.cuda.FloatTensor': the distributed
   optimizer sorts parameters into fp32 and fp16/bf16 groups by those names and refuses any other.
2. `torch.cuda.current_device()` (asked by p2p communication and the DDP grad buffers to place
   tensors, and by multi-latent attention's rotary embeddings, `RotaryEmbedding` / `YarnRotaryEmbedding`, which it
   builds without `use_cpu_initialization` and whose YaRN frequencies it moves there at the first forward) returns
   the CPU device instead of raising "no CUDA GPUs".
3. `torch.cuda.synchronize()` (called around p2p ops and buffer frees) becomes a no-op: CPU ops
   are synchronous.
4. `torch.cuda.current_stream()` (the grad-reduce bucket waits on CUDA-graph events from it) returns
   a stream stand-in whose waits are no-ops; no CUDA graphs exist on CPU.
5. Megatron's optimizer clips gradients with `clip_grad_by_total_norm_fp32`, which asserts
   `torch.cuda.FloatTensor` grads and scales them with a CUDA overflow buffer; the optimizer module's
   reference to it is replaced by `_clip_grads_by_total_norm`, the same scaling with torch foreach ops.
   The grad norm itself is still computed by Megatron (TP/PP-aware, shared parameters counted once).
6. `torch.cuda.is_available()` stays False (Megatron then skips CUDA-only fusions); nothing to patch.
7. Activation recomputation (`tensor_parallel.checkpoint`, used by full and selective recompute) saves the
   CPU RNG state, the CUDA RNG state and the CUDA RNG tracker's states before the forward and restores
   them around the recomputed forward. The CUDA RNG state is read through `random._get_cuda_rng_state` /
   `_set_cuda_rng_state`, which raise without a GPU; they become an empty state and a no-op (the CPU
   RNG state, the only one CPU ops draw from, is still saved and restored by Megatron). For the same
   reason the CUDA RNG tracker's `fork()` (entered around dropout under sequence parallelism; its states
   are seeded by `model_parallel_cuda_manual_seed`, which needs a GPU) runs its block on the CPU RNG.
8. The distributed optimizer (optimizer state sharded over data-parallel ranks) reduce-scatters grads
   and all-gathers the updated weights on flat buffers (`reduce_scatter_tensor`, `all_gather_into_tensor`):
   gloo has both in torch 2.14 (the DP=2 distributed-optimizer layout test runs them); nothing to patch.
9. Without Apex or Transformer Engine (always so on CPU) the distributed optimizer runs torch's Adam, which
   keeps a "step" tensor in every parameter's state. Loading a distributed checkpoint, Megatron puts that
   step back from the param groups, then copies every tensor of the parameter's state from the loaded
   one, which never holds "step" (`_set_main_param_and_optimizer_states` raises KeyError). The copy gets
   the parameter's own step tensor for "step" (`_set_states_keeping_step`), i.e. the step stays Megatron's.
10. The MoE all-to-all token dispatcher (`MoEAlltoAllTokenDispatcher`) creates a class-wide `torch.cuda.Stream()`
    on which it copies its routing counts to the host, records an event on it and synchronises on that event.
    The class's stream is set to the `_NullStream` stand-in up front (its `record_event()` gives an event whose
    `synchronize()` does nothing) and `torch.cuda.stream(...)` becomes a null context. Its host copies
    (`maybe_move_tensor_to_cpu`, which turns the all-to-all split sizes into numpy arrays only when it copies
    them from a GPU) give the CPU tensors' numpy views where it asks for numpy. Its all-to-all over the expert-parallel
    group is `all_to_all_single` with uneven splits, which gloo has in torch 2.14 (the EP=2 tests run it).
11. With expert tensor parallelism (an expert-TP size > 1: TP's unless `expert_tensor_parallel_size` says otherwise;
    none at expert TP 1) the same dispatcher all-gathers the tokens it received over the expert-TP group, and
    reduce-scatters the experts' outputs back, with uneven splits (each expert-TP rank received its own token
    count): `tensor_parallel.mappings._gather_along_first_dim` / `_reduce_scatter_along_first_dim` with split sizes,
    i.e. `all_gather` / `reduce_scatter` over tensor lists of different shapes, which gloo refuses ("invalid tensor
    size"). Those two calls become `all_to_all_single` with uneven splits (every rank
    sends its rows to each peer, or chunk r of its rows to rank r and sums what it gets); even splits, and every
    call on NCCL, go to Megatron's functions unchanged.
12. Mixed precision (bf16 parameters, fp32 main grads and master weights: `Float16OptimizerWithFloat16Params`, or
    the distributed optimizer with its fp32 shards) runs on adaptations 1 and 5 alone: both optimizers sort
    parameters by `Tensor.type()` names ('torch.cuda.BFloat16Tensor', adaptation 1, so they are built inside
    `megatron_device_scope`), the Float16 optimizer allocates its unit loss scale with `device='cuda'` (adaptation 1),
    and for bf16 Megatron copies main params to model params with a plain `copy_` loop (no Apex multi-tensor
    kernel; its overflow buffer is None), so nothing more is patched (tests/trainer/test_parallel_layouts.py runs the
    bf16 step at TP=2, PP=2 and DP=2 with the distributed optimizer).
13. Megatron's rotary embedding under context parallelism picks this CP rank's positions with an index tensor made
    with `pin_memory=True` (`get_pos_emb_on_this_cp_rank`), which asks for a CUDA driver; in the mode of
    adaptation 1 a tensor factory's `pin_memory=True` becomes False (pinned host memory only speeds host-to-GPU
    copies).
Megatron's local `DotProductAttention` is not adapted here: it draws scratch memory from a CUDA
global buffer, so the CPU layer spec swaps in `models.attention.SDPAttention` instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_lock = threading.Lock()
_installed = False
_original_set_states = None  # Megatron's DistributedOptimizer._set_main_param_and_optimizer_states (adaptation 9)


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Adaptation 1: rewrite `device="cuda[:i]"` keyword arguments of torch calls to CPU; `.cuda()` is identity;
    `.type()` of a CPU tensor names its CUDA type; (adaptation 13) `pin_memory=True` becomes False."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", "torch.cuda.", 1)
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):  # adaptation 13
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


class _NullStream:
    """Adaptation 4: a stream whose synchronisation calls do nothing (CPU work is synchronous)."""

    def wait_event(self, event: object) -> None:
        del event

    def wait_stream(self, stream: object) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def record_event(self, event: object = None) -> _NullStream:
        """Adaptation 10: the event recorded on the stand-in stream; it is itself (its `synchronize` does nothing)."""
        del event
        return self


def _clip_grads_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """Adaptation 5: scale grads in place by min(1, max_norm / (total_norm + 1e-6)), as Megatron does."""
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attribute) for p in parameters if getattr(p, attribute, None) is not None]
    clip_coeff = max_norm / (float(total_norm) + 1.0e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _no_cuda_rng_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Adaptation 7: the (absent) CUDA RNG state, an empty tensor."""
    del device, clone, graph_safe
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """Adaptation 7: restoring the (absent) CUDA RNG state does nothing."""
    del new_state, device, graph_safe


@contextlib.contextmanager
def _fork_on_cpu_rng(self, name: str = "model-parallel-rng") -> Iterator[None]:
    """Adaptation 7: `CudaRNGStatesTracker.fork` without a CUDA generator: the block draws from the CPU RNG."""
    del self, name
    yield


def _set_states_keeping_step(self, model_param, tensors) -> None:
    """Adaptation 9: Megatron's state copy with the parameter's own "step" tensor as the source of its step."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    step = self.optimizer.state[main_param].get("step")
    _original_set_states(self, model_param, {"step": step, **tensors} if torch.is_tensor(step) else tensors)


def cpu_compat_needed() -> bool:
    """True when Megatron must be adapted: this process has no usable CUDA device."""
    return not torch.cuda.is_available()


def enable_cpu_compat() -> bool:
    """Install the CPU adaptations process-wide; idempotent; returns True if they are active.

    Does nothing (returns False) when CUDA is available.
    """
    global _installed
    if not cpu_compat_needed():
        return False
    with _lock:
        if not _installed:
            torch.cuda.current_device = lambda: _CPU  # adaptation 2
            torch.cuda.synchronize = lambda device=None: None  # adaptation 3
            torch.cuda.current_stream = lambda device=None: _NullStream()  # adaptation 4
            import megatron.core.optimizer.optimizer as megatron_optimizer

            megatron_optimizer.clip_grad_by_total_norm_fp32 = _clip_grads_by_total_norm  # adaptation 5
            import megatron.core.tensor_parallel.random as megatron_random

            megatron_random._get_cuda_rng_state = _no_cuda_rng_state  # adaptation 7
            megatron_random._set_cuda_rng_state = _set_no_cuda_rng_state  # adaptation 7
            megatron_random.CudaRNGStatesTracker.fork = _fork_on_cpu_rng  # adaptation 7
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

            global _original_set_states
            _original_set_states = DistributedOptimizer._set_main_param_and_optimizer_states
            DistributedOptimizer._set_main_param_and_optimizer_states = _set_states_keeping_step  # adaptation 9
            _adapt_moe_dispatcher()  # adaptation 10
            _adapt_uneven_sequence_collectives()  # adaptation 11
            _installed = True
    return True


def _adapt_moe_dispatcher() -> None:
    """Adaptation 10: the MoE all-to-all token dispatcher's device-to-host side stream, its events and copies."""
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NullStream()
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _host_copy(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
    """Adaptation 10: `maybe_move_tensor_to_cpu` for CPU tensors: the tensor itself, or with `as_numpy` its
    numpy view (the all-to-all split sizes, which `all_to_all_single` takes as a sequence, not a tensor)."""
    del record_stream
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _adapt_uneven_sequence_collectives() -> None:
    """Adaptation 11: uneven-split gather / reduce-scatter along the first dimension as gloo all-to-alls."""
    import megatron.core.tensor_parallel.mappings as mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        """[n_r, ...] on rank r -> [sum(output_split_sizes), ...], every rank's rows in rank order."""
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
        torch.distributed.all_to_all_single(output, input_.repeat(group.size(), *[1] * (input_.dim() - 1)),
                                            output_split_sizes, [input_.shape[0]] * group.size(), group=group)
        return output

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        """[sum(input_split_sizes), ...] on every rank -> rank r's chunk [input_split_sizes[r], ...], summed over ranks."""
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        mine = input_split_sizes[group.rank()]
        received = input_.new_empty((group.size() * mine, *input_.shape[1:]))
        torch.distributed.all_to_all_single(received, input_.contiguous(), [mine] * group.size(), list(input_split_sizes),
                                            group=group)
        return received.view(group.size(), mine, *input_.shape[1:]).sum(0)

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


def cpu_compat_active() -> bool:
    """True after `enable_cpu_compat()` installed the adaptations in this process."""
    return _installed


@contextlib.contextmanager
def megatron_device_scope() -> Iterator[None]:
    """Run a Megatron call with CUDA tensor factories redirected to CPU (adaptation 1).

    Inert (a plain pass-through) when CUDA is available or the adaptations are not enabled.
    """
    if not _installed:
        yield
        return
    with _CudaToCpuMode():
        yield
