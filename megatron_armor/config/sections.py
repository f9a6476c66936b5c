"""The run's general sections: models, layout, data, reward, optimisation, validation, checkpoints, task, logging.

Each section checks its own fields in `__post_init__`, and the rules it shares with other sections in
`check_with(<those sections>)` (`loading.validate` calls them); the chosen algorithm checks its own rules
(megatron_armor.algorithms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_armor.config.base import check_choices, doc, require, require_at_least, section
from megatron_armor.config.builders import Buildable
from megatron_armor.config.lora import LoRAConfig
from megatron_armor.config.recompute import RecomputeConfig


@dataclass
class ModelConfig(Buildable):
    """The policies' checkpoints and how their Megatron models are built; it builds this rank's shard of a policy's
    model."""

    component = "megatron_armor.convert.loading:load_policy_model"

    path: str | None = doc(
        None, "initial policy: HF checkpoint dir or Megatron checkpoint (`armor convert`); also the reference unless ref_path"
    )
    ref_path: str | None = doc(None, "reference/anchor policy, HF or Megatron checkpoint dir (default: path)")
    params_dtype: Literal["float32", "bfloat16"] = doc("float32", "parameter dtype of actor and reference")
    moe_load_balancing: Literal["aux_loss", "seq_aux_loss", "none"] = doc(
        "aux_loss", "MoE models: the router's load-balancing auxiliary loss, over the micro-batch (aux_loss) or per "
        "sequence (seq_aux_loss), when moe_aux_loss_coeff > 0; none: no auxiliary loss"
    )
    moe_aux_loss_coeff: float = doc(
        0.0, "MoE models: coefficient of the load-balancing auxiliary loss added to the policy loss (0: off, as RL "
        "recipes usually run it; the routing is the same either way)"
    )
    lora: LoRAConfig = section(LoRAConfig)

    def __post_init__(self) -> None:
        check_choices("model", self)
        require(self.moe_aux_loss_coeff >= 0, f"model.moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        require(not (self.moe_aux_loss_coeff > 0 and self.moe_load_balancing == "none"),
                "model.moe_aux_loss_coeff > 0 needs model.moe_load_balancing aux_loss or seq_aux_loss")


def expert_tp_size(tp: int, etp: int | None) -> int:
    """Ranks each expert's matrices are split over: `etp` (parallel.expert_tensor_parallel_size), or when unset
    (None) the TP size `tp`, Megatron's default."""
    return tp if etp is None else etp


def check_expert_layout(tp: int, cp: int, dp: int, ep: int, etp: int | None, *, where: str = "") -> None:
    """Megatron's expert layout (`parallel_state.initialize_model_parallel`): the tp x cp x dp ranks of each pipeline
    stage are regrouped for the experts as expert TP (`etp`, None: `tp`) x EP (`ep`) x expert DP (the experts see
    no context parallelism: each CP rank routes its own chunks' tokens), so etp x ep must divide tp x cp x dp (at
    etp = tp: ep divides cp x dp). Raises `ConfigError` naming the fields, each prefixed by `where`."""
    size, shown = expert_tp_size(tp, etp), (f"unset: {tp}, the TP size" if etp is None else etp)
    for name, value in (("expert_parallel_size", ep), ("expert_tensor_parallel_size", size)):
        require(value >= 1, f"{where}{name} must be >= 1, got {value}")
    require((tp * cp * dp) % (size * ep) == 0,
            f"{where}expert_tensor_parallel_size ({shown}) x {where}expert_parallel_size ({ep}) = {size * ep} must "
            f"divide {where}tensor_parallel_size ({tp}) x {where}context_parallel_size ({cp}) x "
            f"{where}data_parallel_size ({dp}) = {tp * cp * dp}: Megatron regroups each pipeline stage's TP x CP x DP "
            f"ranks as expert TP x EP x expert DP")


@dataclass
class ParallelConfig(Buildable):
    """The training layout: tensor, pipeline, context, data and expert parallel sizes (tp x pp x cp x dp processes);
    it builds the rank's `DistributedContext` (torch.distributed and Megatron's process groups)."""

    component = "megatron_armor.distributed.init:distributed_context"

    tensor_parallel_size: int = doc(1, "Megatron tensor-parallel size")
    pipeline_parallel_size: int = doc(1, "Megatron pipeline-parallel size")
    data_parallel_size: int = doc(1, "data-parallel replicas; the job has tp x pp x cp x dp processes")
    context_parallel_size: int = doc(
        1, "context parallelism: each sequence split over this many ranks in 2 x context_parallel_size zig-zag "
        "chunks (rank r keeps chunks r and 2cp-1-r), keys and values exchanged inside attention; for responses "
        "whose activations do not fit one GPU. Weights are not split (no effect on checkpoints or weight sync)"
    )
    expert_parallel_size: int = doc(
        1, "MoE models: the routed experts split over this many ranks (each holds num_experts / expert_parallel_size); "
        "divides the expert count, and times expert_tensor_parallel_size divides tensor_parallel_size x "
        "context_parallel_size x data_parallel_size"
    )
    expert_tensor_parallel_size: int | None = doc(
        None, "MoE models: each expert's matrices split over this many ranks (Megatron's expert TP; unset: "
        "tensor_parallel_size). The experts regroup each pipeline stage's TP x CP x DP ranks as expert TP x EP x "
        "expert DP; e.g. 1 with a large expert_parallel_size keeps every expert whole on its rank"
    )
    sequence_parallel: bool | None = doc(
        None, "Megatron sequence parallelism: the activations outside attention and MLP (norms, residuals, dropout) "
        "split along the sequence over the tensor-parallel ranks; needs tensor_parallel_size > 1; unset: on when "
        "tensor_parallel_size > 1 on GPUs or for a MoE model (which needs it under TP), off otherwise on CPU"
    )

    def __post_init__(self) -> None:
        require_at_least("parallel", self, ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                                            "data_parallel_size"), 1)
        check_expert_layout(self.tensor_parallel_size, self.context_parallel_size, self.data_parallel_size,
                            self.expert_parallel_size, self.expert_tensor_parallel_size, where="parallel.")
        require(not (self.sequence_parallel and self.tensor_parallel_size == 1),
                "parallel.sequence_parallel needs parallel.tensor_parallel_size > 1 (it splits activations over the "
                "tensor-parallel ranks)")

    def resolve_sequence_parallel(self, on_gpu: bool, moe: bool = False) -> bool:
        """sequence_parallel as the run uses it: the value if set, else TP > 1 on GPUs or for a MoE model (`moe`;
        Megatron's MoE layers refuse to train under TP without it), off otherwise on CPU."""
        require(not (moe and self.tensor_parallel_size > 1 and self.sequence_parallel is False),
                f"a MoE model at parallel.tensor_parallel_size {self.tensor_parallel_size} needs sequence parallelism "
                "(Megatron's MoE layers refuse to train under TP without it): set parallel.sequence_parallel true or "
                "leave it unset")
        if self.sequence_parallel is not None:
            return self.sequence_parallel
        return (on_gpu or moe) and self.tensor_parallel_size > 1

    @property
    def world_size(self) -> int:
        return (self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size
                * self.data_parallel_size)


@dataclass
class DataConfig(Buildable):
    """The prompt datasets and how their rows are read and tokenized; it builds the run's prompts (the training
    sampler and the validation rows)."""

    component = "megatron_armor.data.datasets:load_prompts"

    train_path: str | None = doc(None, "training prompts (.jsonl or .parquet with prompt/answer fields)")
    val_path: str | None = doc(None, "validation prompts (same format); none disables validation")
    prompt_key: str = doc(
        "prompt", "row field holding the prompt: text, or a list of {role, content} chat messages (verl parquet "
        "files; needs apply_chat_template)"
    )
    answer_key: str = doc(
        "answer", "row field holding the reference answer; a dotted key reads a nested field (verl parquet files: "
        "reward_model.ground_truth)"
    )
    apply_chat_template: bool = doc(False, "wrap prompts in the tokenizer's chat template")
    max_prompt_length: int = doc(2048, "longest allowed prompt in tokens (longer rows are an error)")
    shuffle: bool = doc(True, "reshuffle training prompts every epoch")

    def __post_init__(self) -> None:
        require_at_least("data", self, ("max_prompt_length",), 1)


@dataclass
class RewardConfig(Buildable):
    """The reward functions (training, validation, audit verifiers) and DAPO's overlong penalty; it builds them,
    loaded (`RewardFns`)."""

    component = "megatron_armor.rewards.reward_fns:RewardFns.load"

    train_fn: str = doc(
        "megatron_armor.rewards.math_dapo:verify", "training reward, module:function or path/to/file.py:function (a "
        "file of your own: no package or PYTHONPATH needed); default: DAPO's exact match of "
        "the last 'Answer:' line, as the ARMOR paper (megatron_armor.rewards.math_verify_reward:verify: math-verify's "
        "value equality, also of a final \\boxed{})"
    )
    val_fn: str | None = doc(None, "validation reward, module:function or path/to/file.py:function (default: train_fn)")
    audit_fns: list[str] = doc(
        [], "audit verifiers (module:function or path/to/file.py:function each) run on every on-policy training sample "
        "beside train_fn and never trained on; logged per step: audit/<stem>_<function>_accuracy, "
        "audit/<stem>_<function>_hack_rate (train_fn says correct, the audit says wrong) and audit/hack_rate (the "
        "largest of those)"
    )
    overlong_buffer: int | None = doc(
        None, "DAPO overlong penalty buffer in tokens: responses longer than rollout.sampling.max_new_tokens minus "
        "this lose reward linearly (0 disables; unset: half of max_new_tokens, at most 4096)"
    )
    overlong_factor: float = doc(1.0, "DAPO overlong penalty factor")

    def __post_init__(self) -> None:
        if self.overlong_buffer is not None:
            require_at_least("reward", self, ("overlong_buffer",), 0)

    def check_with(self, max_new_tokens: int) -> None:
        """The overlong buffer fits in a response of rollout.sampling.max_new_tokens tokens (the penalty
        counts back from it)."""
        require(self.overlong_buffer_for(max_new_tokens) <= max_new_tokens,
                f"reward.overlong_buffer ({self.overlong_buffer}) must be <= rollout.sampling.max_new_tokens "
                f"({max_new_tokens}): the penalty starts that many tokens before the longest response allowed")

    def overlong_buffer_for(self, max_new_tokens: int) -> int:
        """The overlong buffer (tokens) for responses of at most `max_new_tokens`: overlong_buffer if set, else
        max_new_tokens // 2 capped at DAPO's 4096."""
        return self.overlong_buffer if self.overlong_buffer is not None else min(4096, max_new_tokens // 2)


@dataclass
class TrainConfig:
    train_batch_size: int = doc(512, "prompts per RL step")
    gen_batch_size: int = doc(2048, "prompts per generation batch")
    mini_batch_size: int = doc(32, "prompts per optimizer step")
    logprob_head: Literal["auto", "torch", "fused"] = doc(
        "auto", "LM head scoring: torch (vocab-sharded logits), fused (Triton kernel; GPU, or interpreter on CPU), "
        "auto (fused on GPU, torch on CPU)"
    )
    max_steps: int = doc(200, "RL steps to run")
    max_consecutive_skips: int = doc(
        3, "stop the run (after checkpointing the last good state) when this many RL steps in a row skipped "
        "their update for a non-finite loss or gradient (0: never stop)"
    )
    nonfinite_rollback: bool = doc(
        True, "a step skipped for a non-finite loss or gradient leaves nothing behind: the mini-batches stepped "
        "before the non-finite one are undone from a copy of this rank's weights and optimizer state taken in host "
        "memory before every update of more than one mini-batch (one device-to-host copy of them per RL step, "
        "and that much host memory); false keeps those mini-batches applied and takes no copy"
    )
    routing_replay: Literal["none", "rollout", "recompute"] = doc(
        "none", "MoE routing replay in the actor's forwards: none (the trainer's routers choose), rollout (R3: the old-"
        "logprob pass and the update route every token to the experts the rollout engine routed it to; the engines "
        "record them, SGLang servers need --enable-return-routed-experts) or recompute (R2: the update replays the "
        "routing of the old-logprob pass, so the update's ratios see only weight changes, not routing changes); "
        "gradients still reach the routers through the replayed experts' probabilities"
    )
    seed: int = doc(1234, "seed of data order, sampling and initialisation")

    def __post_init__(self) -> None:
        check_choices("train", self)
        require_at_least(
            "train", self, ("train_batch_size", "gen_batch_size", "mini_batch_size", "max_steps"), 1
        )
        require_at_least("train", self, ("max_consecutive_skips",), 0)
        require(self.train_batch_size % self.mini_batch_size == 0,
                f"train.mini_batch_size ({self.mini_batch_size}) must divide train.train_batch_size "
                f"({self.train_batch_size})")

    def check_with(self, parallel: ParallelConfig, recompute: RecomputeConfig) -> None:
        """The rules this section shares with others: the data-parallel split of a mini-batch (`parallel`) and
        routing replay under `recompute`."""
        dp = parallel.data_parallel_size
        require(self.mini_batch_size % dp == 0,
                f"train.mini_batch_size ({self.mini_batch_size}) must be divisible by parallel.data_parallel_size "
                f"({dp}) so every data-parallel rank trains on the same number of prompts")
        require(self.routing_replay == "none" or recompute.granularity != "full",
                f"train.routing_replay {self.routing_replay} cannot run with recompute.granularity full: a recomputed "
                f"layer's router would route again in the backward, without the replayed experts; use selective or "
                f"none")


@dataclass
class EvalConfig:
    every: int = doc(5, "validate every N steps (0: never)")
    before_train: bool = doc(True, "validate before the first step")
    max_prompts: int | None = doc(None, "use only the first N validation prompts (of data.val_path)")
    datasets: str | None = doc(
        None, "YAML list of evaluation datasets, the file `armor eval --datasets` reads (docs/guides/evaluation.md): "
        "each is validated and logged as val/<name>/avg@n, pass@k, ... (a dataset with an agentic section is rolled "
        "out as trajectories of its environment and adds turns_mean, tool_calls_mean, tool_error_rate); the first "
        "one's (or eval.primary's) avg@n is val/accuracy. None: data.val_path, sampled rollout.sampling.val_n times, logged as val/accuracy (the MIPU "
        "gate reads data.val_path either way)"
    )
    primary: str | None = doc(
        None, "the dataset of eval.datasets whose avg@n is val/accuracy (which the collapse monitor's alarms and "
        "checkpoint.keep_best: val/accuracy read); None: the first"
    )

    def __post_init__(self) -> None:
        require_at_least("eval", self, ("every",), 0)
        require(self.max_prompts is None or self.max_prompts >= 1,
                f"eval.max_prompts must be >= 1 or null, got {self.max_prompts}")
        require(self.primary is None or self.datasets is not None,
                f"eval.primary ({self.primary!r}) names a dataset of eval.datasets, which is not set")


@dataclass
class CheckpointConfig(Buildable):
    """When checkpoints are saved, how many are kept and which is the best; it builds the run's `CheckpointSaver`."""

    component = "megatron_armor.trainer.checkpointing.checkpoint_save:checkpoint_saver"

    every: int = doc(20, "save a checkpoint every N steps (and at the end)")
    keep_last: int = doc(2, "keep the newest N checkpoints (0: keep all)")
    save_model: bool = doc(
        True, "also write the actor as a Megatron distributed checkpoint (step_N/model/) for `armor convert` / `diagnose`"
    )
    save_peft: bool = doc(
        True, "under model.lora: also write the adapters in Hugging Face PEFT's format (step_N/peft/: "
        "adapter_config.json + adapter_model.safetensors, for peft.PeftModel.from_pretrained on the HF base "
        "model.path); the final adapter is the last checkpoint's, the best the one checkpoints/BEST names"
    )
    async_save: bool = doc(
        False, "write each rank's checkpoint shards in the background while training goes on; the checkpoint is "
        "marked COMPLETE at the next save or the end of the run, once every rank has written"
    )

    keep_best: str | None = doc(
        None, "also keep the checkpoint with the best value of this validation metric (e.g. val/accuracy), never "
        "pruned by keep_last, named in checkpoints/BEST and logged as checkpoint/best_step; needs a validation at "
        "every checkpoint (checkpoint.every a multiple of eval.every)"
    )
    best_mode: Literal["max", "min"] = doc("max", "keep_best: whether a higher (max) or lower (min) value is better")

    def __post_init__(self) -> None:
        check_choices("checkpoint", self)
        require_at_least("checkpoint", self, ("every",), 1)
        require_at_least("checkpoint", self, ("keep_last",), 0)
        require(self.keep_best is None or self.keep_best.startswith("val/"),
                f"checkpoint.keep_best must name a validation metric (val/...), got {self.keep_best!r}")

    def check_with(self, eval: EvalConfig) -> None:
        """keep_best compares validations: one must run at every checkpoint (`eval`.every)."""
        require(self.keep_best is None or (eval.every > 0 and self.every % eval.every == 0),
                f"checkpoint.keep_best {self.keep_best} needs a validation at every checkpoint: checkpoint.every "
                f"({self.every}) must be a multiple of eval.every ({eval.every}), and eval.every > 0")


@dataclass
class WarmStartConfig:
    """The synthetic task's supervised warm start (trainer/run/warmstart.py): the tiny model is fine-tuned on the
    task's worked solutions (AdamW, train.seed) until its sampled (T=1) accuracy on held-out rows reaches
    target_accuracy, for at most `steps` optimizer steps; the result is cached in task.cache_dir."""

    steps: int = doc(0, "supervised warm-start steps of the synthetic model at most (0: none)")
    target_accuracy: float = doc(0.6, "stop the warm start at this sampled accuracy")
    lr: float = doc(3e-3, "warm-start learning rate (AdamW, no weight decay)")
    batch_size: int = doc(64, "rows per warm-start step")
    eval_every: int = doc(50, "warm-start steps between accuracy measurements")
    eval_rows: int = doc(64, "the first rows of the training rows, held out to measure the accuracy on")
    tool_fraction: float = doc(
        0.0, "fraction of the rows shown as a tool-using conversation of rollout.agentic.environment (its "
        "`demonstration(row)`, rendered by rollout.agentic.chat_template, assistant turns trained); the rest as worked "
        "solutions. The accuracy is measured without tools"
    )

    def __post_init__(self) -> None:
        require_at_least("task.warm_start", self, ("steps",), 0)
        require_at_least("task.warm_start", self, ("batch_size", "eval_every", "eval_rows"), 1)
        require(0.0 <= self.tool_fraction <= 1.0,
                f"task.warm_start.tool_fraction must be in [0, 1], got {self.tool_fraction}")


@dataclass
class TaskConfig:
    synthetic: Literal["arithmetic"] | None = doc(None, "generate a synthetic task (and tiny model) in cache_dir")
    num_train_rows: int = doc(2000, "synthetic training prompts")
    num_val_rows: int = doc(200, "synthetic validation prompts")
    min_terms: int = doc(2, "fewest operands of a synthetic arithmetic problem")
    max_terms: int = doc(3, "most operands of a synthetic arithmetic problem (longer chains: a harder task)")
    cache_dir: str = doc(".cache/megatron-armor", "where synthetic assets and warm starts are cached")
    warm_start: WarmStartConfig = section(WarmStartConfig)

    def __post_init__(self) -> None:
        check_choices("task", self)
        require(2 <= self.min_terms <= self.max_terms,
                f"task needs 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")

    def check_with(self, model: ModelConfig, data: DataConfig, environment: str | None) -> None:
        """Without a synthetic task the run's model and prompts come from the `model` and `data` sections; tool
        demonstrations in the warm start come from the run's `environment` (rollout.agentic.environment)."""
        if self.synthetic is None:
            require(model.path is not None,
                    "model.path is required (an HF checkpoint directory) unless task.synthetic is set")
            require(data.train_path is not None, "data.train_path is required unless task.synthetic is set")
        require(self.warm_start.tool_fraction == 0.0 or environment is not None,
                "task.warm_start.tool_fraction > 0 needs rollout.agentic.environment (the demonstrations' source)")


@dataclass
class LoggingConfig(Buildable):
    """Where metrics go (the run directory's metrics.jsonl, TensorBoard, Weights & Biases) and the progress bar;
    it builds the run's `MetricsLogger`."""

    component = "megatron_armor.utils.metrics:MetricsLogger"

    run_dir: str = doc("runs/armor", "run directory: metrics.jsonl, curves.png, checkpoints/")
    tensorboard: bool = doc(True, "write TensorBoard scalars")
    wandb_project: str | None = doc(None, "log to this Weights & Biases project (needs wandb)")
    plot: bool = doc(True, "write curves.png at the end")
    progress_bar: bool = doc(True, "show a progress bar")
    update_geometry_every: int = doc(
        0, "every N RL steps log the update's geometry per decoder layer type (geometry/*: relative update norm, "
        "fraction of weights changed under the bf16-aware rule, drift from the reference's weights); costs a copy of "
        "the decoder matrices on those steps (0: never)"
    )

    def __post_init__(self) -> None:
        require_at_least("logging", self, ("update_geometry_every",), 0)
