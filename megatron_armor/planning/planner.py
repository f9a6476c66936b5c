"""A run's plan: its config and hardware -> the per-GPU bytes of every part of training (`MemoryPlan`), whether
they fit, the knobs that make them fit, and the FLOPs of one RL step (`RunPlan`). Bytes are per GPU; the
activations and logits are those of the largest micro-batch a rank trains on."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_armor.config import ArmorConfig, LoRAConfig, RecomputeConfig, check_expert_layout
from megatron_armor.models.hf_config import ModelShape, check_parallel_layout
from megatron_armor.planning.activations import ActivationBytes, LogitsBytes, activation_bytes, logits_bytes
from megatron_armor.planning.flops import RLStepFlops, rl_step_flops
from megatron_armor.planning.memory import Layout, StateBytes, parameter_count, state_bytes
from megatron_armor.planning.shapes import resolve_model_shape

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
CP_KNOB = "set parallel.context_parallel_size"
LAYOUT_KNOBS = ("raise tp", CP_KNOB)  # knobs that regroup the GPUs, advised one at a time


@dataclass(frozen=True)
class PlanInputs:
    """What the memory plan depends on. `micro_batch_tokens`: tokens of the largest micro-batch (padded);
    `micro_batches`: micro-batches per optimizer step on one rank; `frozen`: (name, shape) of the frozen models
    every rank holds (the reference; an in-process OPD teacher); `gpu_bytes`, `reserve_bytes`: a GPU's memory and
    what the CUDA context, communication buffers and fragmentation take; `colocated`: rollout servers share the
    trainer's GPUs (`offload_trainer`: the trainer parks its state in host memory while they generate), each
    server sharded over `server_tp` GPUs and taking `server_mem_fraction` of a GPU's memory for its weights and KV
    cache (SGLang's --mem-fraction-static)."""

    shape: ModelShape
    layout: Layout
    micro_batch_tokens: int
    micro_batches: int
    frozen: tuple[tuple[str, ModelShape], ...]
    gpu_bytes: int
    reserve_bytes: int
    colocated: bool = False
    offload_trainer: bool = False
    server_tp: int = 1
    server_mem_fraction: float = 0.8


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU bytes of each part of training under `inputs`. `frozen`: weights of each frozen model;
    `logits`: the configured head's, `logits_torch` / `logits_fused` both heads'; `kv_cache`: what a rollout
    server's KV cache has on a GPU: its memory fraction of the GPU, less its bf16 weights shard (colocated: at most
    what the trainer's state that stays on the GPU during rollouts and the reserve leave); negative when even its
    weights do not fit."""

    inputs: PlanInputs
    state: StateBytes
    frozen: dict[str, int]
    activations: ActivationBytes
    logits: LogitsBytes
    logits_torch: LogitsBytes
    logits_fused: LogitsBytes
    kv_cache: int

    @property
    def training_peak(self) -> int:
        """Bytes a GPU needs while it trains: state, frozen models, activations and logits at their peak, reserve."""
        state = self.state.weights + self.state.gradients + self.state.optimizer
        return (state + sum(self.frozen.values()) + self.activations.peak + self.logits.peak
                + self.inputs.reserve_bytes)

    @property
    def fits(self) -> bool:
        return self.training_peak <= self.inputs.gpu_bytes and (not self.inputs.colocated or self.kv_cache > 0)


def memory_plan(inputs: PlanInputs) -> MemoryPlan:
    """The per-GPU bytes of `inputs` (see `MemoryPlan`)."""
    shape, layout, tokens = inputs.shape, inputs.layout, inputs.micro_batch_tokens
    state = state_bytes(shape, layout)
    frozen = {name: parameter_count(model, layout.tp, layout.pp, layout.ep, layout.etp) * layout.dtype_bytes
              for name, model in inputs.frozen}
    server_weights = parameter_count(shape, inputs.server_tp, 1) * 2  # SGLang serves bf16
    resident = 0 if inputs.offload_trainer or not inputs.colocated else (
        state.weights + state.gradients + state.optimizer + sum(frozen.values()))
    return MemoryPlan(
        inputs=inputs, state=state, frozen=frozen,
        activations=activation_bytes(shape, layout, tokens, inputs.micro_batches),
        logits=logits_bytes(shape, layout, tokens),
        logits_torch=logits_bytes(shape, layout.with_(head="torch"), tokens),
        logits_fused=logits_bytes(shape, layout.with_(head="fused"), tokens),
        kv_cache=int(min(inputs.gpu_bytes * inputs.server_mem_fraction,
                         inputs.gpu_bytes - inputs.reserve_bytes - resident)) - server_weights,
    )


def knob_changes(inputs: PlanInputs, max_len: int) -> list[tuple[str, PlanInputs]]:
    """(the knob to turn, the inputs with it turned) for every memory knob this layout has not turned yet."""
    layout, changes = inputs.layout, []
    if layout.recompute.granularity != "full":
        changes.append(("turn on recompute.granularity full", replace(inputs, layout=layout.with_(
            recompute=RecomputeConfig("full", "uniform", 1)))))
    if layout.head != "fused":
        changes.append(("set train.logprob_head fused", replace(inputs, layout=layout.with_(head="fused"))))
    if layout.dp_cp > 1 and not layout.distributed_optimizer:  # the state is replicated over DP x CP
        changes.append(("set optimizer.use_distributed_optimizer true", replace(
            inputs, layout=layout.with_(distributed_optimizer=True))))
    if layout.tp > 1 and not layout.sequence_parallel:
        changes.append(("set parallel.sequence_parallel true", replace(
            inputs, layout=layout.with_(sequence_parallel=True))))
    if inputs.micro_batch_tokens > max_len:
        changes.append((f"set micro_batching.max_tokens {max_len} (one longest sequence per micro-batch)",
                        replace(inputs, micro_batch_tokens=max_len)))
    for tp in (2 * layout.tp, 4 * layout.tp):
        dp = max(layout.dp * layout.tp // tp, 1)  # on as many GPUs, where dp allows
        raised = layout.with_(tp=tp, dp=dp, sequence_parallel=True)
        if tp <= 8 and _splits(inputs.shape, raised):
            changes.append((f"raise tp to {tp} (dp {dp}; sequence parallel)", replace(inputs, layout=raised)))
    for cp in (2 * layout.cp, 4 * layout.cp):  # the padding to the larger multiple (< 2 x cp x tp tokens) left out
        dp = max(layout.dp * layout.cp // cp, 1)
        raised = layout.with_(cp=cp, dp=dp)
        if _splits(inputs.shape, raised):
            changes.append((f"{CP_KNOB} {cp} (dp {dp}; each sequence split over {cp} GPUs)",
                            replace(inputs, layout=raised)))
    return changes


def _splits(shape: ModelShape, layout: Layout) -> bool:
    """Whether `layout` splits `shape` (`check_parallel_layout`) and its experts (`check_expert_layout`)."""
    try:
        check_parallel_layout(shape, layout.tp, layout.pp, layout.ep, layout.etp)
        check_expert_layout(layout.tp, layout.cp, layout.dp, layout.ep, layout.etp)
    except ValueError:
        return False
    return True


def _all_memory_knobs(inputs: PlanInputs, max_len: int) -> PlanInputs:
    """`inputs` with every knob but a TP or CP raise (`LAYOUT_KNOBS`) turned, one after another."""
    while rest := [changed for knob, changed in knob_changes(inputs, max_len) if not knob.startswith(LAYOUT_KNOBS)]:
        inputs = rest[0]
    return inputs


def advice(inputs: PlanInputs, max_len: int) -> list[str]:
    """What to turn when `inputs` do not fit: each knob with the peak it gives ("fits" when it does), those that
    fit first, then by peak; then, when no single knob fits, all of them but a TP raise together."""
    rows = []
    for knob, changed in knob_changes(inputs, max_len):
        plan = memory_plan(changed)
        rows.append((not plan.fits, plan.training_peak, f"{knob}: peak {plan.training_peak / GIB:.1f} GiB"
                     + (" (fits)" if plan.fits else "")))
    combined = memory_plan(_all_memory_knobs(inputs, max_len))
    if not any(fits is False for fits, _, _ in rows):
        rows.append((not combined.fits, combined.training_peak, "all of the above but a tp or cp raise, together: peak "
                     f"{combined.training_peak / GIB:.1f} GiB" + (" (fits)" if combined.fits else "")))
    return [text for _, _, text in sorted(rows)]


@dataclass(frozen=True)
class Hardware:
    """The GPUs a run is planned on: `gpus` in all (trainer and rollout servers), `gpu_memory_gb` each (GB, 10^9
    bytes), `reserve_gb` GiB of each kept for the CUDA context, NCCL buffers and fragmentation; an SGLang server's
    `server_tp` (None: the trainer's TP) and `server_mem_fraction` (its --mem-fraction-static)."""

    gpus: int
    gpu_memory_gb: float
    reserve_gb: float = 4.0
    server_tp: int | None = None
    server_mem_fraction: float = 0.8


@dataclass(frozen=True)
class RunPlan:
    """A config's plan: `memory` (per GPU), `advice` (empty when it fits), `flops` of one RL step with every
    sequence at `max_len` tokens (an upper bound: real responses are shorter), `sequences` per RL step,
    `trainer_gpus` = tp x pp x cp x dp of the `gpus` in all, and where the model's shape came from;
    `longest_without_cp` / `longest_with_cp`: the longest max_new_tokens (1024-token steps) that fits the config's
    layout at the (cp, dp) of `without_cp` / `with_cp` (`context_layouts`; None: no CP layout for this model on
    these GPUs); `full_finetune`: under LoRA, the memory of the same run training every weight (gradients and
    optimizer state of all of them, the frozen reference copy), what the adapters save; None without LoRA."""

    memory: MemoryPlan
    advice: list[str]
    flops: RLStepFlops
    sequences: int
    max_len: int
    gpus: int
    trainer_gpus: int
    shape_source: str
    without_cp: tuple[int, int]
    longest_without_cp: int
    with_cp: tuple[int, int] | None
    longest_with_cp: int | None
    full_finetune: MemoryPlan | None = None


def plan_inputs(cfg: ArmorConfig, algorithm, hardware: Hardware) -> PlanInputs:
    """The `PlanInputs` of a run's config on `hardware`, planned as on GPUs
    (sequence parallelism's default on, logprob_head auto = fused); `algorithm`: `build_algorithm(cfg)`."""
    shape, _ = resolve_model_shape(cfg.model.path)
    train, par = cfg.train, cfg.parallel
    check_parallel_layout(shape, par.tensor_parallel_size, par.pipeline_parallel_size, par.expert_parallel_size,
                          par.expert_tensor_parallel_size)
    check_context_groups(par.tensor_parallel_size * par.pipeline_parallel_size, par.context_parallel_size,
                         hardware.gpus)
    layout = Layout(
        tp=par.tensor_parallel_size, pp=par.pipeline_parallel_size, dp=par.data_parallel_size,
        cp=par.context_parallel_size, ep=par.expert_parallel_size, etp=par.expert_tensor_parallel_size,
        sequence_parallel=par.resolve_sequence_parallel(on_gpu=True, moe=bool(shape.num_experts)),
        distributed_optimizer=cfg.optimizer.distributed(par, cfg.subspace, cfg.rollout.memory), dtype_bytes=DTYPE_BYTES[cfg.model.params_dtype],
        recompute=cfg.recompute,
        head="torch" if train.logprob_head == "torch" else "fused", lora=cfg.model.lora,
    )
    max_len = padded_length(cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens, layout)
    rank_sequences = train.mini_batch_size * cfg.rollout.sampling.n_samples // layout.dp
    batching = cfg.micro_batching
    if batching.max_tokens:
        tokens = max(batching.max_tokens, max_len)
        micro_batches = -(-rank_sequences * max_len // batching.max_tokens)
    else:
        tokens, micro_batches = batching.micro_batch_size * max_len, -(-rank_sequences // batching.micro_batch_size)
    return PlanInputs(
        shape=shape, layout=layout, micro_batch_tokens=tokens, micro_batches=micro_batches,
        frozen=(*_reference(cfg, shape), *_in_process_teacher(cfg, algorithm, shape)), gpu_bytes=int(hardware.gpu_memory_gb * 1e9),
        reserve_bytes=int(hardware.reserve_gb * GIB), colocated=cfg.rollout.memory.release_servers,
        offload_trainer=cfg.rollout.memory.offload_trainer, server_tp=hardware.server_tp or layout.tp,
        server_mem_fraction=hardware.server_mem_fraction,
    )


def padded_length(seq_len: int, layout: Layout) -> int:
    """A sequence's length as the trainer feeds it: under context parallelism padded to a multiple of 2 x cp x tp
    (2 x cp zig-zag chunks, each rank's pair split over the TP ranks: `scoring.context_split`); as is at cp 1."""
    step = 2 * layout.cp * layout.tp if layout.cp > 1 else 1
    return -(-seq_len // step) * step


def check_context_groups(model_parallel: int, cp: int, gpus: int) -> None:
    """Raise ValueError unless a model replica's tp x pp x `cp` ranks (`model_parallel` = tp x pp) tile the `gpus`
    under context parallelism (a CP group is never split over what is left of the GPUs)."""
    if cp > 1 and gpus % (model_parallel * cp):
        raise ValueError(f"parallel.context_parallel_size {cp}: a model replica's tp x pp x cp = "
                         f"{model_parallel * cp} GPUs do not divide the {gpus} GPUs (--gpus); choose a context-parallel "
                         f"size that makes tp x pp x cp a divisor of {gpus}")


def _reference(cfg: ArmorConfig, shape: ModelShape) -> tuple[tuple[str, ModelShape], ...]:
    """(("reference", shape),): the frozen copy each rank holds; none under LoRA (the base with adapters off)."""
    return () if cfg.model.lora.enabled else (("reference", shape),)


def _in_process_teacher(cfg: ArmorConfig, algorithm, student: ModelShape) -> tuple[tuple[str, ModelShape], ...]:
    """(("teacher", shape),) when the algorithm scores with a teacher in the trainer's processes, else ()."""
    from megatron_armor.algorithms import TEACHER  # imports torch, as building `algorithm` did

    opd = cfg.opd
    if not algorithm.sources.uses(TEACHER) or opd.teacher_url or opd.teacher_layout is not None:
        return ()
    return (("teacher", resolve_model_shape(opd.teacher_path)[0] if opd.teacher_path else student),)


def context_layouts(cfg: ArmorConfig, shape: ModelShape,
                    gpus: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(cp, dp) of `cfg`'s GPUs without context parallelism, and with it: the configured CP size, or at CP 1 the CP
    raise `knob_changes` advises (2, on as many GPUs where dp allows); None where the model's layout does not split
    at that CP size or the `gpus` cannot hold it."""
    par = cfg.parallel
    replicas = par.data_parallel_size * par.context_parallel_size
    model_parallel = par.tensor_parallel_size * par.pipeline_parallel_size
    cp = par.context_parallel_size if par.context_parallel_size > 1 else 2
    dp = max(replicas // cp, 1)
    layout = Layout(tp=par.tensor_parallel_size, pp=par.pipeline_parallel_size, dp=dp, cp=cp,
                    ep=par.expert_parallel_size, etp=par.expert_tensor_parallel_size)
    held = model_parallel * cp * dp <= gpus and gpus % (model_parallel * cp) == 0
    return (1, replicas), ((cp, dp) if held and _splits(shape, layout) else None)


def longest_response(cfg: ArmorConfig, algorithm, hardware: Hardware, cp: tuple[int, int], *, step: int = 1024,
                     limit: int = 2**22) -> int:
    """The longest rollout.sampling.max_new_tokens, a multiple of `step` tokens, whose plan fits `hardware` with
    the config's context-parallel and data-parallel sizes set to `cp` = (cp, dp); 0 when `step` tokens do not fit,
    `limit` when that does (the plan's bytes grow with the response, so a bisection finds it)."""
    parallel = replace(cfg.parallel, context_parallel_size=cp[0], data_parallel_size=cp[1])

    def fits(tokens: int) -> bool:
        sampling = replace(cfg.rollout.sampling, max_new_tokens=tokens)
        changed = replace(cfg, parallel=parallel, rollout=replace(cfg.rollout, sampling=sampling))
        return memory_plan(plan_inputs(changed, algorithm, hardware)).fits

    low, high = 0, limit // step  # fits(low * step) (or low = 0); not fits(high * step) unless high is the limit
    if fits(limit):
        return limit
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle)
    return low * step


def plan_run(cfg: ArmorConfig, hardware: Hardware) -> RunPlan:
    """Plan `cfg` on `hardware` (the trainer takes tp x pp x cp x dp of its GPUs)."""
    from megatron_armor.algorithms import REFERENCE, TEACHER, build_algorithm  # imports torch

    algorithm = build_algorithm(cfg)
    inputs = plan_inputs(cfg, algorithm, hardware)
    memory = memory_plan(inputs)
    max_len = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    fed = padded_length(max_len, inputs.layout)
    without_cp, with_cp = context_layouts(cfg, inputs.shape, hardware.gpus)
    sequences = cfg.train.train_batch_size * cfg.rollout.sampling.n_samples
    teacher = None
    if algorithm.sources.uses(TEACHER):  # in-process or a server: its forward counts alike
        teacher = resolve_model_shape(cfg.opd.teacher_path)[0] if cfg.opd.teacher_path else inputs.shape
    return RunPlan(
        memory=memory, advice=[] if memory.fits else advice(inputs, fed),
        flops=rl_step_flops(inputs.shape, [max_len] * sequences, reference=REFERENCE in algorithm.sources.scores,
                            teacher=teacher, old_logprobs=not algorithm.old_logprobs_from_update(
                                cfg.train.train_batch_size // cfg.train.mini_batch_size)),
        sequences=sequences, max_len=max_len, gpus=hardware.gpus, trainer_gpus=cfg.parallel.world_size,
        shape_source=resolve_model_shape(cfg.model.path)[1],
        without_cp=without_cp, longest_without_cp=longest_response(cfg, algorithm, hardware, without_cp),
        with_cp=with_cp, longest_with_cp=longest_response(cfg, algorithm, hardware, with_cp) if with_cp else None,
        full_finetune=full_finetune_plan(inputs) if cfg.model.lora.enabled else None,
    )


def full_finetune_plan(inputs: PlanInputs) -> MemoryPlan:
    """The memory of LoRA `inputs` trained without adapters: every weight with gradients and optimizer state, and the
    reference as a frozen copy of its own."""
    return memory_plan(replace(inputs, layout=inputs.layout.with_(lora=LoRAConfig()),
                               frozen=(("reference", inputs.shape), *inputs.frozen)))
