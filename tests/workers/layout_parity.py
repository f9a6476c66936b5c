"""Worker: one ARMOR step on a fixed batch under given TP x PP (x DP) layouts, one job after another.

argv: out_dir job... with job = name,actor_dir,ref_dir,tp,pp,head[,option...] (head "torch" | "fused"; option
"distopt": Megatron's distributed optimizer, state sharded over DP ranks; "sp": sequence parallelism; "budget=N":
micro-batches of at most N tokens instead of 2 sequences; "packed": packed micro-batches, THD; "ep=N": a MoE model's
experts over N expert-parallel ranks; "etp=N": each expert over N expert-TP ranks (default: TP's); "aux=C": its
load-balancing auxiliary loss at coefficient C; "replay=MODE": train.routing_replay MODE, with "rollout" replaying
random routes given to the on-policy samples as an engine's; "bf16": bf16 parameters trained through Megatron's
mixed-precision optimizer, fp32 master weights and grads; "clip=C": ARMOR's clip at C instead of 0.003; "cp=N":
context parallelism, each sequence over N ranks; "recompute=G": recompute.granularity G (full: every layer, uniform
chunks of one; selective: the core attention); "masked": every response holds two tokens the policy did not sample
(a multi-turn trajectory's tool result: loss_mask 0) after its first; "agentic": the batch is rolled out first, the
whole step's rollout on multi-turn trajectories (`trajectory_groups`: the requests dealt over every rank, each seeded
on its own), and each rank also saves the groups' samples; "lora": the actor trains rank-4 LoRA adapters (a
MoE model's experts too) and the reference is the actor's model with them off; "checkpoint": after the step, the
actor (adapters only under "lora") and its optimizer saved as a trainer checkpoint in `<name>/checkpoints/step_000001`
(recorded: its path and the actor's base directory), and (one process, plain optimizer) each trained parameter's Adam
moments recorded);
the process
group is started once and Megatron's parallel state rebuilt for each job (process start-up is most of
a job's cost). For each job every rank saves `<name>/rank<r>.pt` with its shard's old/ref logprobs and old entropy
(keyed by sequence), the routing metrics of the old-logprob pass (MoE), the full HF-named gradients of the first
mini-batch, whether the output weight's
gradient went straight into Megatron's main_grad (`grad_added_to_main_grad`; None off the last stage),
the step's loss metrics, how many times Megatron's activation checkpoint ran (recomputation), the full weights before and after the step (two optimizer steps, one per mini-batch), the bytes of
its optimizer's state tensors, the step's update geometry (diagnostics/step_geometry.py), and (option distopt) whether a deep copy of the optimizer's `state_dict()` taken
after the step (as MIPU's snapshot and the checkpoints take it) puts the state back exactly once a third step changed it.
"""
import copy
import functools

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused head runs in Triton's CPU interpreter here

import torch  # noqa: E402

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from algorithm_factory import make_algorithm  # noqa: E402
from launcher import write_result  # noqa: E402
from state_trees import adam_moments  # noqa: E402

from megatron_armor.algorithms import build_groups  # noqa: E402
from megatron_armor.convert.peft_export import all_stages_peft_tensors  # noqa: E402
from megatron_armor.convert.weights import gather_all_stages_hf_weights, load_hf_weights  # noqa: E402
from megatron_armor.data.datasets import PromptRow  # noqa: E402
from megatron_armor.data.types import Sample  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402

from megatron_armor.diagnostics.step_geometry import StepGeometry  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, destroy_model_parallel, initialize_distributed  # noqa: E402
from megatron_armor.config import (  # noqa: E402
    AgenticConfig, AlgorithmConfig, AnchorsConfig, LoRAConfig, MicroBatchingConfig, OptimizerConfig, RecomputeConfig,
    RolloutConfig, TrainConfig,
)
from megatron_armor.models.lora import adapters_disabled, apply_lora, full_adapters  # noqa: E402
from megatron_armor.models.gpt import build_gpt_model  # noqa: E402
from megatron_armor.models.hf_config import MoERouting, load_model_shape, transformer_config  # noqa: E402
from megatron_armor.models.tiny import make_char_tokenizer  # noqa: E402
from megatron_armor.rollout.base import SamplingParams  # noqa: E402
from megatron_armor.rollout.local import LocalEngine  # noqa: E402
from megatron_armor.scoring.logprobs import ScoringConfig, forward_backward  # noqa: E402
from megatron_armor.trainer.checkpointing.checkpoint_save import save_checkpoint  # noqa: E402
from megatron_armor.trainer.checkpointing.sharded_state import sharded_modules  # noqa: E402
from megatron_armor.trainer.rollouts.samples import generate_samples  # noqa: E402
from megatron_armor.trainer.rollouts.trajectories import TrajectoryScorer  # noqa: E402
from megatron_armor.trainer.step_inputs.plan import StepPlan  # noqa: E402
from megatron_armor.trainer.step_inputs.policies import Policy, PolicyHandles  # noqa: E402
from megatron_armor.trainer.update.optimizer import wrap_for_training, zero_grads  # noqa: E402
from megatron_armor.trainer.update.policy_update import PolicyLossCallback, update_policy  # noqa: E402
from megatron_armor.trainer.update.training_batch import advantage_batch, score_logprobs  # noqa: E402
from megatron_armor.scoring.micro_batches import MicroBatching  # noqa: E402
from megatron_armor.scoring.routes import routing_pass  # noqa: E402

RECOMPUTE = {"full": RecomputeConfig("full", "uniform", 1), "selective": RecomputeConfig("selective")}
CHECKPOINTS = []  # one entry per call of Megatron's activation checkpoint (what recomputation runs through)


def counted_checkpoint(*args, _checkpoint=tensor_parallel.checkpoint):
    CHECKPOINTS.append(1)
    return _checkpoint(*args)


tensor_parallel.checkpoint = counted_checkpoint


def fixed_groups(num_groups=4, group_size=4, masked=False):
    """Random sequences of varying length; one correct anchor closes each group. `masked`: response tokens 1 and 2 of
    every sample are context, not sampled (loss_mask 0, engine logprob 0), as a trajectory's tool result is."""
    g = torch.Generator().manual_seed(123)
    groups = []
    for p in range(num_groups):
        prompt = torch.randint(1, 96, (3 + p,), generator=g).tolist()
        group = []
        for k in range(group_size):
            response = torch.randint(1, 96, (4 + (p * 3 + k) % 7,), generator=g).tolist()
            correct = k % 2 == 0 or k == group_size - 1
            group.append(Sample(p, prompt, response, [0.0] * len(response), "stop", k == group_size - 1,
                                1.0 if correct else -1.0, correct,
                                loss_mask=[1, 0, 0] + [1] * (len(response) - 3) if masked else None))
        groups.append(group)
    return groups


AGENTIC_TASK = Path(__file__).parents[1] / "trainer" / "agentic_task"


def trajectory_groups(actor_dir: str, ref_dir: str, num_groups: int = 4) -> list[list[Sample]]:
    """A step's rollout as the rollout phase makes it, on multi-turn trajectories: 10 prompts, each rolled out as a
    two-turn trajectory of `TwoTurnParity` (tests/trainer/agentic_task/) three times by the actor's in-process engine
    and twice by the reference's (ARMOR's anchors), the requests dealt over every rank (`generate_samples`, the
    trajectory scorer's seed per request), grouped and filtered (`build_groups`); the first `num_groups` groups. The
    template keeps only the last character of an earlier answer (char_chat_strip.jinja) and the trajectories fork on
    drift: one whose first answer is longer is two samples."""
    agentic = AgenticConfig(environment=f"{AGENTIC_TASK / 'two_turns.py'}:TwoTurnParity",
                            chat_template=str(AGENTIC_TASK / "char_chat_strip.jinja"), max_turns=2, on_drift="fork")
    tokenizer = make_char_tokenizer()
    scorer = TrajectoryScorer.load(agentic, tokenizer, in_process=True)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    prompts = [PromptRow(i, tokenizer.encode(f"{i}+{i + 1}="), {"prompt": f"{i}+{i + 1}="}) for i in range(10)]
    on_policy = generate_samples(LocalEngine(actor_dir), prompts, 3, sampling, scorer, is_anchor=False,
                                 seed=(0, 0, 0, "actor"))
    anchors = generate_samples(LocalEngine(ref_dir), prompts, 2, sampling, scorer, is_anchor=True,
                               seed=(0, 0, 0, "anchors"))
    groups, _ = build_groups(on_policy + anchors, require_anchor=True, filter_groups=True)
    if len(groups) < num_groups:
        raise RuntimeError(f"the rollout kept {len(groups)} groups, the step needs {num_groups}")
    return groups[:num_groups]


def sample_records(groups: list[list[Sample]]) -> list[list[tuple]]:
    """Each sample's tokens, loss mask, engine logprobs, reward, anchor flag and trajectory number, by group (plain
    lists: loadable with torch.load's weights_only)."""
    return [[(s.prompt_ids, s.response_ids, s.loss_mask, s.engine_logprobs, s.reward, s.is_anchor, s.trajectory)
             for s in group] for group in groups]


def give_random_routes(groups, layers, experts, top_k) -> None:
    """Routes [P + R - 1, layers, top_k] of distinct random experts for every on-policy sample (an engine's)."""
    g = torch.Generator().manual_seed(7)
    for sample in (s for group in groups for s in group if not s.is_anchor):
        fed = len(sample.prompt_ids) + len(sample.response_ids) - 1
        sample.routed_experts = torch.rand(fed, layers, experts, generator=g).argsort(-1)[..., :top_k].to(torch.int32)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the Adam state tensors (moments, steps) this rank's optimizer holds."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(value.numel() * value.element_size() for part in parts if getattr(part, "optimizer", None)
               for state in part.optimizer.state.values() for value in state.values() if torch.is_tensor(value))


def state_round_trip_is_exact(optimizer, step) -> bool:
    """Save the optimizer's state_dict (deep copy), `step()` once more, load the copy: the state is the copy."""
    saved = copy.deepcopy(optimizer.state_dict())
    step()
    optimizer.load_state_dict(copy.deepcopy(saved))
    flat = lambda state: [t for t in torch.utils._pytree.tree_leaves(state) if torch.is_tensor(t)]  # noqa: E731
    now = flat(optimizer.state_dict())
    return len(now) == len(flat(saved)) and all(torch.equal(a, b) for a, b in zip(now, flat(saved)))


def gather_sharded_grads(ddp) -> None:
    """Distributed optimizer: the reduce-scatter leaves each DP (x CP) rank the reduced grads of its slice of every
    bucket only; all-gather the slices so main_grad holds the whole reduced gradient, as plain DDP leaves it."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    for buffer in ddp.buffers:
        for bucket in buffer.buckets:
            size = bucket.grad_data.numel() // world
            torch.distributed.all_gather_into_tensor(
                bucket.grad_data, bucket.grad_data[rank * size: (rank + 1) * size].clone(), group=group)


def every_stage_adapters(ddp, use_grads=False) -> dict[str, torch.Tensor]:
    """Every pipeline stage's and expert-parallel rank's adapters (or their reduced gradients) whole, on every rank."""
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, {k: v.clone() for k, v in full_adapters(ddp, use_grads=use_grads).items()})
    return {name: tensor for part in parts for name, tensor in part.items()}


def run_job(name: str, actor_dir: str, ref_dir: str, tp: int, pp: int, head: str, *options: str) -> None:
    CHECKPOINTS.clear()
    ep = next((int(option.removeprefix("ep=")) for option in options if option.startswith("ep=")), 1)
    etp = next((int(option.removeprefix("etp=")) for option in options if option.startswith("etp=")), None)
    cp = next((int(option.removeprefix("cp=")) for option in options if option.startswith("cp=")), 1)
    ctx = initialize_distributed(tp, pp, seed=0, expert_parallel_size=ep, expert_tensor_parallel_size=etp,
                                 context_parallel_size=cp)
    shape = load_model_shape(actor_dir)

    aux = next((float(option.removeprefix("aux=")) for option in options if option.startswith("aux=")), 0.0)

    dtype = torch.bfloat16 if "bf16" in options else torch.float32
    recompute = next((RECOMPUTE[option.removeprefix("recompute=")] for option in options
                      if option.startswith("recompute=")), RecomputeConfig())

    def model(path, trainable):
        config = transformer_config(shape, tp_size=tp, pp_size=pp, sequence_parallel="sp" in options, ep_size=ep,
                                    etp_size=etp, moe=MoERouting(aux_loss_coeff=aux), params_dtype=dtype, cp_size=cp,
                                    recompute=recompute)
        m = build_gpt_model(shape, config, trainable=trainable).to(dtype=dtype)  # as convert.loading.load_gpt_model
        load_hf_weights(m, path, shape)
        return m

    optim = OptimizerConfig(lr=1e-3, warmup_steps=0)
    actor = model(actor_dir, True)
    lora = "lora" in options
    if lora:
        apply_lora(actor, LoRAConfig(rank=4, alpha=8.0, experts=bool(shape.num_experts)), seed=0)
    ddp, optimizer = wrap_for_training(optim, model=actor, distributed="distopt" in options)
    ref = (Policy("ref", ddp, view=functools.partial(adapters_disabled, ddp)) if lora
           else Policy("ref", model(ref_dir, False)))
    handles = PolicyHandles(actor=Policy("actor", ddp, adapters_only=lora), ref=ref, optimizer=optimizer, shape=shape, pad_token_id=0)
    # A clip this tight binds on part of the second mini-batch (scored after the first optimizer step), so the
    # layouts are compared on clipped and unclipped tokens alike; "clip=C" widens it (bf16's logprobs differ by more
    # than 0.003 between layouts: a clip that tight flips on noise).
    clip = next((option.removeprefix("clip=") for option in options if option.startswith("clip=")), "0.003")
    algorithm = make_algorithm("armor", "armor.alpha=0.75", f"algorithm.clip_low={clip}", f"algorithm.clip_high={clip}")
    budget = next((int(option.removeprefix("budget=")) for option in options if option.startswith("budget=")), None)
    replay = next((option.removeprefix("replay=") for option in options if option.startswith("replay=")), "none")
    plan = StepPlan(algorithm, TrainConfig(train_batch_size=4, mini_batch_size=2, routing_replay=replay, seed=0),
                    RolloutConfig(anchors=AnchorsConfig(ref_n=1)), AlgorithmConfig(max_num_gen_batches=1),
                    MicroBatching(MicroBatchingConfig(2, max_tokens=budget, pack="packed" in options)), actor_n=3)
    scoring = ScoringConfig(temperature=1.0, head=head)
    groups = trajectory_groups(actor_dir, ref_dir) if "agentic" in options else fixed_groups(masked="masked" in options)
    if replay == "rollout":
        give_random_routes(groups, shape.num_layers, shape.num_experts, shape.moe_top_k)
    advantaged = advantage_batch(groups, plan, dp_size=ctx.dp_size, dp_rank=ctx.dp_rank, pad_token_id=0)
    prepared = score_logprobs(advantaged, handles, plan, scoring, optimizer_steps=0, dp_rank=ctx.dp_rank)
    batch = prepared.batch
    logprobs, entropy = {}, {}
    for row in range(batch.size):
        mask = batch.response_mask[row].bool()
        key = str(batch.input_ids[row][: int(mask.nonzero().max()) + 2].tolist())
        logprobs[key] = (batch.old_logprobs[row][mask], batch.ref_logprobs[row][mask])
        entropy[key] = prepared.old_entropy[row][mask]

    forward_backward(ddp, plan.micro_batching.split(prepared.mini_batches[0]), PolicyLossCallback(algorithm),
                     scoring=scoring, forward_only=False, routing=routing_pass(ddp, prepared.mini_batches[0]))
    if "distopt" in options:
        gather_sharded_grads(ddp)
    grads = (every_stage_adapters(ddp, use_grads=True) if lora else
             {name: g.clone() for name, g in gather_all_stages_hf_weights(ddp.module, shape, use_grads=True)})
    head_weight = ddp.module.output_layer.weight if ddp.module.post_process else None
    if head_weight is None and ddp.module.post_process:  # tied to the embedding on this stage
        head_weight = ddp.module.shared_embedding_or_output_weight()
    head_in_main_grad = None if head_weight is None or lora else head_weight.grad_added_to_main_grad  # LoRA: frozen
    zero_grads(ddp, optimizer)

    initial_weights = {name: w.clone() for name, w in gather_all_stages_hf_weights(ddp.module, shape)}
    geometry = StepGeometry.capture(ddp.module)
    update = update_policy(ddp, optimizer, prepared.mini_batches, micro_batching=plan.micro_batching,
                           algorithm=algorithm, scoring=scoring, optim=optim, rl_step=0)
    step_geometry = geometry.metrics(ddp.module, handles.ref.module)
    weights = {name: w.clone() for name, w in gather_all_stages_hf_weights(ddp.module, shape)}  # LoRA: merged
    adapters = every_stage_adapters(ddp) if lora else None
    # what an adapter push sends (copied: on the CPU they may be the live parameters, which the round trip steps)
    peft = {k: v.clone() for k, v in all_stages_peft_tensors(ddp.module, shape).items()} if lora else None
    ref_after = handles.ref.score(batch, micro_batching=plan.micro_batching, scoring=scoring) if lora else None
    moments, saved = None, None
    if "checkpoint" in options:  # before the round trip below steps once more
        modules = sharded_modules({"actor": handles.actor, "optimizer": optimizer}, is_loading=False)
        saved = {"path": str(save_checkpoint(Path(out_dir) / name, 1, {"modules": modules})), "base": actor_dir}
        moments = adam_moments(ddp.module, optimizer) if ctx.world_size == 1 else None
    state_bytes = optimizer_state_bytes(optimizer)
    round_trip = "distopt" in options and state_round_trip_is_exact(optimizer, lambda: update_policy(
        ddp, optimizer, prepared.mini_batches[:1], micro_batching=plan.micro_batching, algorithm=algorithm,
        scoring=scoring, optim=optim, rl_step=1))
    (Path(out_dir) / name).mkdir(exist_ok=True)
    torch.save({"logprobs": logprobs, "entropy": entropy, "routing_metrics": prepared.routing_metrics, "grads": grads,
                "head_in_main_grad": head_in_main_grad,
                "metrics": update.metrics, "initial_weights": initial_weights, "weights": weights, "geometry": step_geometry,
                "optimizer_state_bytes": state_bytes, "state_round_trip_exact": round_trip,
                "adapters": adapters, "peft": peft, "ref_logprobs_before_and_after": (batch.ref_logprobs, ref_after),
                "adam_moments": moments, "checkpoint": saved, "checkpointed": len(CHECKPOINTS),
                "samples": sample_records(groups) if "agentic" in options else None,
                "layout": (ctx.tp_size, ctx.pp_size, ctx.dp_size)}, Path(out_dir) / name / f"rank{ctx.rank}.pt")
    destroy_model_parallel()  # the next job builds its own layout on the same process group


out_dir, *jobs = sys.argv[1:]
for job in jobs:
    name, actor_dir, ref_dir, tp, pp, head, *options = job.split(",")
    run_job(name, actor_dir, ref_dir, int(tp), int(pp), head, *options)
write_result(out_dir, {"jobs": len(jobs)})
destroy_distributed()
