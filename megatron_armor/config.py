"""Typed run configuration: dataclasses per stage, YAML + `section.field=value` overrides, validation.

Defaults follow the ARMOR 7B recipe (armor.md section 6) where one applies.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration value that is missing, unknown, of the wrong type, or out of range."""


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    path: str | None = _f(
        None, "initial policy: HF checkpoint dir or Megatron checkpoint (`armor convert`); also the reference unless ref_path"
    )
    ref_path: str | None = _f(None, "reference/anchor policy, HF or Megatron checkpoint dir (default: path)")
    params_dtype: Literal["float32", "bfloat16"] = _f("float32", "parameter dtype of actor and reference")
    teacher_path: str | None = _f(
        None, "HF checkpoint dir of the frozen OPD teacher (same vocabulary; may be larger; built with the student's "
        "TP/PP; synthetic task: default the warm start, distilled into the untrained model)"
    )
    teacher_url: str | None = _f(
        None, "comma-separated URLs of running OPD teacher scoring servers (`armor serve-teacher`, or SGLang "
        "serving the teacher); instead of a teacher in the trainer's processes"
    )
    teacher_tensor_parallel_size: int | None = _f(
        None, "OPD teacher at its own layout: the trainer starts a scoring server of model.teacher_path with this "
        "tensor-parallel size (null: the teacher shares the student's processes and layout)"
    )
    teacher_pipeline_parallel_size: int | None = _f(
        None, "pipeline-parallel size of the teacher server the trainer starts (null: 1 when "
        "teacher_tensor_parallel_size is set)"
    )

    @property
    def teacher_layout(self) -> tuple[int, int] | None:
        """(tp, pp) of the teacher server the trainer starts, or None when it starts none."""
        if self.teacher_tensor_parallel_size is None and self.teacher_pipeline_parallel_size is None:
            return None
        return self.teacher_tensor_parallel_size or 1, self.teacher_pipeline_parallel_size or 1


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = _f(1, "Megatron tensor-parallel size")
    pipeline_parallel_size: int = _f(1, "Megatron pipeline-parallel size")
    data_parallel_size: int = _f(1, "data-parallel replicas; the job has tp x pp x dp processes")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


@dataclass
class DataConfig:
    train_path: str | None = _f(None, "training prompts (.jsonl or .parquet with prompt/answer fields)")
    val_path: str | None = _f(None, "validation prompts (same format); none disables validation")
    prompt_key: str = _f(
        "prompt", "row field holding the prompt: text, or a list of {role, content} chat messages (verl parquet "
        "files; needs apply_chat_template)"
    )
    answer_key: str = _f(
        "answer", "row field holding the reference answer; a dotted key reads a nested field (verl parquet files: "
        "reward_model.ground_truth)"
    )
    apply_chat_template: bool = _f(False, "wrap prompts in the tokenizer's chat template")
    max_prompt_length: int = _f(2048, "longest allowed prompt in tokens (longer rows are an error)")
    shuffle: bool = _f(True, "reshuffle training prompts every epoch")


@dataclass
class RewardConfig:
    train_fn: str = _f(
        "megatron_armor.rewards.math_dapo:verify", "training reward, module:function; default: DAPO's exact match of "
        "the last 'Answer:' line, as the ARMOR paper (megatron_armor.rewards.math_verify_reward:verify: math-verify's "
        "value equality, also of a final \\boxed{})"
    )
    val_fn: str | None = _f(None, "validation reward, module:function (default: train_fn)")
    overlong_buffer: int = _f(4096, "DAPO overlong penalty buffer in tokens (0 disables)")
    overlong_factor: float = _f(1.0, "DAPO overlong penalty factor")


@dataclass
class RolloutConfig:
    backend: Literal["local", "sglang"] = _f("local", "rollout engine: local (in-process HF model) or sglang (HTTP servers)")
    sglang_urls: str | None = _f(None, "comma-separated URLs of the actor's SGLang servers (backend sglang)")
    sglang_ref_urls: str | None = _f(
        None, "comma-separated URLs of the reference policy's servers (ARMOR anchors, anchor_engine separate)"
    )
    sglang_update_bucket_mb: int = _f(512, "weight-update bucket size in MiB (backend sglang)")
    weight_sync: Literal["tensor", "distributed", "disk"] = _f(
        "tensor", "how weights reach the SGLang servers (backend sglang): tensor = /update_weights_from_tensor with "
        "shared-memory / CUDA-IPC handles, for servers on the trainer ranks' hosts (colocated: each host's servers get "
        "the weights from that host's ranks); distributed = a process "
        "group with the servers and /update_weights_from_distributed broadcasts (gloo on CPU, nccl on GPU), for "
        "servers on other hosts (disaggregated); disk = safetensors files (one per bucket) in a fresh subdirectory "
        "of weight_sync_dir and /update_weights_from_disk (fallback)"
    )
    weight_sync_dir: str | None = _f(None, "directory the servers can read, for weight_sync disk")
    weight_sync_payload: Literal["flattened_bucket", "per_tensor"] = _f(
        "flattened_bucket", "payload of weight_sync tensor: flattened_bucket = each bucket packed into one staging "
        "buffer, sent as one handle (SGLang's load_format flattened_bucket); per_tensor = SGLang's load_format null: "
        "tensors the servers can map where they are go as handles to the trainer's own storage, with no staging copy "
        "(every CUDA tensor; on CPU the weights the push reads in place, which each pushing rank then keeps in "
        "shared memory unless offload_trainer), the rest (on CPU: TP-gathered, split fused QKV) is staged"
    )
    router: Literal["auto", "sglang", "none"] = _f(
        "auto", "dispatch of generation requests over the SGLang servers (backend sglang): auto (SGLang's router "
        "for 2+ servers when the sglang_router package is installed, else the client's least-loaded dispatcher) | sglang (the "
        "router; an error if it is not installed) | none (the client's dispatcher). Weight updates, flushes and "
        "health checks go to every server directly either way"
    )
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = _f(
        "cache_aware", "load-balancing policy of SGLang's router (sglang_router --policy)"
    )
    sglang_router_url: str | None = _f(
        None, "URL of a running SGLang router in front of sglang_urls (armor ray-train sets it); unset: each trainer "
        "process starts its own router on loopback when rollout.router picks one"
    )
    sglang_ref_router_url: str | None = _f(None, "the same for sglang_ref_urls")
    release_memory: bool = _f(
        False, "servers on the trainer's GPUs (colocated; started with --enable-memory-saver) release their GPU memory "
        "while the trainer computes and take it back before each weight push (backend sglang; armor ray-train "
        "--placement colocated sets it)"
    )
    offload_trainer: bool = _f(
        False, "the trainer's weights, optimizer state and grad buffers leave the GPU for host memory while the "
        "rollout servers generate (the actor's weights come back after each update for the push, the MIPU gate and "
        "validation), so colocated servers fit beside it; costs about two host-device copies of them per step and "
        "that much page-locked host memory (armor ray-train --placement colocated sets it; on CPU it saves nothing)"
    )
    engine_precision: Literal["fp32", "bf16", "fp8"] = _f(
        "fp32", "weights of the local engine rounded to fp32 | bf16 | fp8 (simulated e4m3, per-row scale): the "
        "training/inference mismatch of production engines (backend local)"
    )
    n_samples: int = _f(16, "group size per prompt")
    actor_n: int = _f(15, "on-policy samples per prompt")
    ref_n: int = _f(4, "anchor samples per prompt from the reference policy (ARMOR)")
    temperature: float = _f(1.0, "sampling temperature of training rollouts")
    top_p: float = _f(1.0, "nucleus sampling of training rollouts")
    max_new_tokens: int = _f(8192, "maximum response length in tokens")
    val_temperature: float = _f(1.0, "sampling temperature of validation")
    val_top_p: float = _f(0.7, "nucleus sampling of validation")
    val_n: int = _f(1, "samples per validation prompt")
    anchor_engine: Literal["separate", "shared"] = _f(
        "separate", "engine of ARMOR's anchors: separate (the reference's own: an in-process copy, or "
        "sglang_ref_urls) | shared (the actor's engine; the reference's weights are pushed in before an anchor "
        "phase and the actor's pushed back before on-policy sampling)"
    )
    cache_anchors: bool = _f(
        False, "reuse a prompt's anchors (key: its prompt token ids) at later steps until the reference is reset, "
        "instead of regenerating them every step as ARMOR does; the cache is saved in checkpoints"
    )
    anchor_cache_max_prompts: int = _f(
        4096, "prompts the anchor cache holds (least recently used evicted first); each holds ref_n anchors "
        "(token ids + logprobs: tens of bytes per token, in memory and in trainer_state.json)"
    )


@dataclass
class AlgorithmConfig:
    name: Literal["armor", "grpo", "grpo_kl", "mipu", "opd"] = _f(
        "armor", "armor | grpo (alpha=1, no anchors) | grpo_kl | mipu (sampler-referenced loss + gated sync) | "
        "opd (on-policy distillation from model.teacher_path)"
    )
    alpha: float = _f(0.9375, "actor weight of the mixed ratio (armor)")
    clip_low: float = _f(0.2, "PPO ratio clip epsilon below 1")
    clip_high: float | None = _f(
        None, "PPO ratio clip epsilon above 1; default: clip_low for mipu (symmetric eps, mipu.md §2), 0.28 otherwise"
    )
    dual_clip: float | None = _f(
        None, "dual-clip constant c bounding negative-advantage losses; default: 1 + 2 clip_low for mipu (1.4), "
        "10 otherwise"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k3", "KL estimator of grpo_kl and mipu")
    kl_coef: float = _f(0.001, "KL-to-reference loss coefficient of grpo_kl and mipu (0: off)")
    ref_reset_period: int = _f(
        0, "copy the actor into the reference every N steps (0: frozen); checkpoints then hold the reference, and "
        "a resume restores a checkpoint's reference whatever this is set to"
    )
    filter_groups: bool = _f(True, "drop prompts whose on-policy samples are all correct or all wrong")
    max_num_gen_batches: int = _f(10, "generation batches per step before giving up on filling the batch")
    allow_partial_batch: bool = _f(
        False, "train on fewer prompts instead of failing when filtering leaves too few (cut to a multiple of "
        "parallel.data_parallel_size; a step left with none skips its update: train/update_skipped)"
    )
    adv_eps: float = _f(1e-6, "epsilon of the GRPO advantage normalisation")
    advantage_baseline: Literal["mean", "quantile"] = _f(
        "mean", "baseline b of A = (R - b) / (std + eps) within a group: mean (GRPO) | quantile (QAE: "
        "baseline_quantile of the group's rewards, linear interpolation)"
    )
    baseline_quantile: float = _f(0.45, "quantile of the QAE baseline (advantage_baseline quantile)")
    mipu_is_correction: Literal["tis", "mis", "none"] = _f(
        "tis", "mipu Step 1 weight of pi_old/mu per token: tis min(w, w_max) | mis 1[w <= w_max] | none"
    )
    mipu_w_max: float = _f(2.0, "mipu truncation / masking bound of the importance weight")
    mipu_gate: bool = _f(True, "mipu Step 2: accept or roll back each update by the post-update gap proxy")
    mipu_c_start: float = _f(4e-3, "mipu tolerance c at step 0 (accept iff gap proxy >= -c)")
    mipu_c_end: float = _f(1e-3, "mipu tolerance c after the ramp")
    mipu_ramp_steps: int = _f(100, "mipu steps over which c goes linearly from c_start to c_end")
    mipu_gate_prompts: int = _f(
        8, "mipu held-out prompts (from the validation set, scored by reward.val_fn without the overlong penalty) "
        "per gate check; the gate's accept decisions then depend on validation prompts, so report accuracy on "
        "a separate test set when that matters"
    )
    mipu_gate_n: int = _f(8, "mipu responses per held-out prompt (validation group size)")
    opd_beta: float = _f(1.0, "opd reverse-KL coefficient beta of A_t = -beta (log pi_old - log q_teacher)")
    opd_alpha: float = _f(1.0, "opd weight of the distillation advantage; 1 - alpha goes to the GRPO advantage")
    opd_token_fraction: float = _f(
        1.0, "opd token sparsification rho in (0, 1]: keep ceil(rho T) of a response's T tokens, rescale their "
        "r_t by T / kept (1: off)"
    )
    opd_token_selection: Literal["top", "random"] = _f(
        "top", "opd tokens kept under sparsification: top (largest r_t = log pi_old - log q_teacher) | random"
    )
    opd_rollouts: Literal["student", "teacher"] = _f(
        "student", "opd training responses: student (on-policy, sampled by the actor's engine) | teacher (the "
        "off-policy variant: sampled by a never-synced engine of model.teacher_path, scored and trained on exactly "
        "as student ones, no importance correction; needs the ratio clip off, algorithm.clip_low = clip_high = "
        "1.0, and rollout.backend local); train/reward_mean and train/accuracy then measure the teacher's samples, "
        "opd/reverse_kl is the mean r_t on them (an estimate of -KL(q_teacher || pi)), and mismatch/* is not logged"
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean"] | None = _f(
        None, "policy-loss reduction: token_mean (over all response tokens) | seq_mean_token_mean (token mean per "
        "response, then mean over responses); default: seq_mean_token_mean for mipu (J_S1), token_mean otherwise"
    )

    @property
    def aggregation(self) -> str:
        """`loss_aggregation`, or the algorithm's default when it is unset."""
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        return "seq_mean_token_mean" if self.name == "mipu" else "token_mean"

    @property
    def effective_clip_high(self) -> float:
        """`clip_high`, or the algorithm's default when it is unset: clip_low for mipu, 0.28 otherwise."""
        if self.clip_high is not None:
            return self.clip_high
        return self.clip_low if self.name == "mipu" else 0.28

    @property
    def effective_dual_clip(self) -> float:
        """`dual_clip`, or the algorithm's default when it is unset: 1 + 2 clip_low for mipu, 10 otherwise."""
        if self.dual_clip is not None:
            return self.dual_clip
        return 1.0 + 2.0 * self.clip_low if self.name == "mipu" else 10.0


@dataclass
class TrainConfig:
    train_batch_size: int = _f(512, "prompts per RL step")
    gen_batch_size: int = _f(2048, "prompts per generation batch")
    mini_batch_size: int = _f(32, "prompts per optimizer step")
    micro_batch_size: int = _f(8, "sequences per forward/backward")
    lr: float = _f(1e-6, "peak learning rate")
    warmup_steps: int = _f(
        10, "linear warmup over this many RL steps (all mini-batches of step k use lr * min(1, (k + 1) / "
        "warmup_steps), as verl's per-RL-step scheduler), then constant"
    )
    weight_decay: float = _f(0.1, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    grad_clip: float = _f(1.0, "global gradient-norm clip")
    subspace_capture_step: int = _f(
        0, "subspace-constrained training: after this RL step, confine updates to the top-K span of the "
        "cumulative update so far (0: off)"
    )
    subspace_k: int = _f(16, "K of subspace-constrained training")
    subspace_mode: Literal["gradient", "update"] = _f(
        "gradient", "project the gradient before Adam, or the parameter change after it"
    )
    logprob_head: Literal["auto", "torch", "fused"] = _f(
        "auto", "LM head scoring: torch (vocab-sharded logits), fused (Triton kernel; GPU, or interpreter on CPU), "
        "auto (fused on GPU, torch on CPU)"
    )
    max_steps: int = _f(200, "RL steps to run")
    seed: int = _f(1234, "seed of data order, sampling and initialisation")


@dataclass
class EvalConfig:
    every: int = _f(5, "validate every N steps (0: never)")
    before_train: bool = _f(True, "validate before the first step")
    max_prompts: int | None = _f(None, "use only the first N validation prompts")


@dataclass
class CheckpointConfig:
    every: int = _f(20, "save a checkpoint every N steps (and at the end)")
    keep_last: int = _f(2, "keep the newest N checkpoints (0: keep all)")
    save_model: bool = _f(
        True, "also write the actor as a Megatron distributed checkpoint (step_N/model/) for `armor convert` / `diagnose`"
    )


@dataclass
class TaskConfig:
    synthetic: Literal["arithmetic"] | None = _f(None, "generate a synthetic task (and tiny model) in cache_dir")
    num_train_rows: int = _f(2000, "synthetic training prompts")
    num_val_rows: int = _f(200, "synthetic validation prompts")
    warm_start_steps: int = _f(0, "supervised warm-start steps of the synthetic model (0: none)")
    warm_start_target_accuracy: float = _f(0.6, "stop the warm start at this sampled accuracy")
    cache_dir: str = _f(".cache/megatron-armor", "where synthetic assets and warm starts are cached")


@dataclass
class LoggingConfig:
    run_dir: str = _f("runs/armor", "run directory: metrics.jsonl, curves.png, checkpoints/")
    tensorboard: bool = _f(True, "write TensorBoard scalars")
    wandb_project: str | None = _f(None, "log to this Weights & Biases project (needs wandb)")
    plot: bool = _f(True, "write curves.png at the end")
    progress_bar: bool = _f(True, "show a progress bar")


@dataclass
class ArmorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def config_fields() -> list[tuple[str, dataclasses.Field]]:
    """Every (`section.field`, Field) of ArmorConfig, in declaration order."""
    out = []
    for section in dataclasses.fields(ArmorConfig):
        for f in dataclasses.fields(section.default_factory()):
            out.append((f"{section.name}.{f.name}", f))
    return out


def _hints(section_cls) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a YAML/CLI value to `annotation` (int, float, bool, str, Literal, Optional)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in options:
                return None
        inner = [a for a in options if a is not type(None)]
        return coerce(value, inner[0], where)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not allowed; choose one of {list(allowed)}")
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected a boolean (true/false), got {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool) or (annotation is int and isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
        try:
            return annotation(float(value)) if annotation is int and isinstance(value, float) else annotation(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}") from None
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported type {annotation}")


def _unknown(name: str, known: list[str], kind: str) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {known}"
    return ConfigError(f"unknown config {kind} {name!r}{hint}")


def _set(cfg: ArmorConfig, dotted: str, value: Any) -> None:
    section_name, _, field_name = dotted.partition(".")
    sections = [f.name for f in dataclasses.fields(ArmorConfig)]
    if section_name not in sections:
        raise _unknown(section_name, sections, "section")
    section = getattr(cfg, section_name)
    names = [f.name for f in dataclasses.fields(section)]
    if field_name not in names:
        raise _unknown(dotted, [f"{section_name}.{n}" for n in names], "field")
    setattr(section, field_name, coerce(value, _hints(type(section))[field_name], dotted))


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> ArmorConfig:
    """Defaults <- YAML file <- `section.field=value` overrides, then `validate`."""
    cfg = ArmorConfig()
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: invalid YAML ({error})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping")
            for name, value in values.items():
                _set(cfg, f"{section}.{name}", value)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        _set(cfg, key.strip(), yaml.safe_load(value) if value.strip() else value)
    validate(cfg)
    return cfg


def validate(cfg: ArmorConfig) -> None:
    """Cross-field rules; each error names the field, its value and what is allowed."""

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    positive = [
        "parallel.tensor_parallel_size", "parallel.pipeline_parallel_size", "parallel.data_parallel_size",
        "data.max_prompt_length",
        "rollout.n_samples", "rollout.actor_n", "rollout.max_new_tokens", "rollout.val_n",
        "rollout.anchor_cache_max_prompts",
        "algorithm.max_num_gen_batches", "train.train_batch_size", "train.gen_batch_size",
        "train.mini_batch_size", "train.micro_batch_size", "train.max_steps", "checkpoint.every",
    ]
    for dotted in positive:
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name)
        require(value >= 1, f"{dotted} must be >= 1, got {value}")
    for dotted in ("train.warmup_steps", "eval.every", "checkpoint.keep_last", "algorithm.ref_reset_period",
                   "reward.overlong_buffer", "task.warm_start_steps"):
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name)
        require(value >= 0, f"{dotted} must be >= 0, got {value}")
    a, r, t = cfg.algorithm, cfg.rollout, cfg.train
    require(0.0 < a.alpha <= 1.0, f"algorithm.alpha must be in (0, 1], got {a.alpha}")
    clip_high, dual_clip = a.effective_clip_high, a.effective_dual_clip
    require(a.clip_low >= 0 and clip_high >= 0, f"algorithm.clip_low/clip_high must be >= 0, got {a.clip_low}/{clip_high}")
    require(a.clip_low <= 1, f"algorithm.clip_low must be <= 1 (1: no lower clip), got {a.clip_low}")
    require(dual_clip > 1, f"algorithm.dual_clip must be > 1, got {dual_clip}")
    require(0.0 <= a.baseline_quantile <= 1.0, f"algorithm.baseline_quantile must be in [0, 1], got {a.baseline_quantile}")
    require(a.kl_coef >= 0, f"algorithm.kl_coef must be >= 0, got {a.kl_coef}")
    require(a.mipu_w_max > 0, f"algorithm.mipu_w_max must be > 0, got {a.mipu_w_max}")
    require(a.mipu_ramp_steps >= 0, f"algorithm.mipu_ramp_steps must be >= 0, got {a.mipu_ramp_steps}")
    require(a.mipu_gate_prompts >= 1, f"algorithm.mipu_gate_prompts must be >= 1, got {a.mipu_gate_prompts}")
    require(a.mipu_gate_n >= 2, f"algorithm.mipu_gate_n must be >= 2 for group advantages, got {a.mipu_gate_n}")
    require(0.0 <= a.opd_alpha <= 1.0, f"algorithm.opd_alpha must be in [0, 1], got {a.opd_alpha}")
    require(0.0 < a.opd_token_fraction <= 1.0,
            f"algorithm.opd_token_fraction must be in (0, 1] (1 keeps every token), got {a.opd_token_fraction}")
    require(a.opd_token_fraction == 1.0 or a.name == "opd",
            f"algorithm.opd_token_fraction ({a.opd_token_fraction}) sparsifies opd's per-token advantages; "
            f"{a.name} has none: leave it at 1.0")
    require(a.loss_aggregation in (None, "token_mean", "seq_mean_token_mean"),
            f"algorithm.loss_aggregation must be token_mean, seq_mean_token_mean or null (the algorithm's default), "
            f"got {a.loss_aggregation!r}")
    m = cfg.model
    for name in ("teacher_tensor_parallel_size", "teacher_pipeline_parallel_size"):
        value = getattr(m, name)
        require(value is None or value >= 1, f"model.{name} must be >= 1 or null, got {value}")
    require(m.teacher_url is None or m.teacher_layout is None,
            f"model.teacher_url ({m.teacher_url}) and model.teacher_tensor/pipeline_parallel_size both pick the "
            f"teacher: set the URL of a running server, or the layout of one the trainer starts, not both")
    require(a.name == "opd" or (m.teacher_url is None and m.teacher_layout is None),
            f"model.teacher_url / teacher_*_parallel_size configure the OPD teacher; {a.name} has none: unset them")
    if a.name == "opd":
        require(m.teacher_layout is None or m.teacher_path is not None or cfg.task.synthetic is not None,
                "model.teacher_tensor/pipeline_parallel_size start a teacher server of model.teacher_path: set "
                "model.teacher_path (or model.teacher_url for a server that runs already)")
        require(m.teacher_url is not None or m.teacher_path is not None
                or (cfg.task.synthetic is not None and cfg.task.warm_start_steps > 0),
                "model.teacher_path is required for algorithm.name opd (an HF checkpoint dir of the teacher; the "
                "synthetic task with task.warm_start_steps > 0 uses its warm start), or model.teacher_url")
        if a.opd_rollouts == "teacher":
            require(a.clip_low == 1.0 and clip_high == 1.0,
                    f"algorithm.opd_rollouts teacher trains on off-policy tokens with the PPO ratio clip off (eps = "
                    f"1.0, opd.md §1): set algorithm.clip_low=1.0 algorithm.clip_high=1.0, got "
                    f"{a.clip_low}/{clip_high}")
            require(r.backend == "local",
                    "algorithm.opd_rollouts teacher samples from an in-process engine of model.teacher_path; "
                    "rollout.backend sglang has no teacher rollout servers: use rollout.backend local, or "
                    "algorithm.opd_rollouts student")
            require(m.teacher_path is not None or (cfg.task.synthetic is not None and cfg.task.warm_start_steps > 0),
                    "algorithm.opd_rollouts teacher needs the teacher's weights in the trainer for its rollout engine: "
                    "set model.teacher_path (an HF checkpoint dir; model.teacher_url alone only scores)")
    require(a.name == "opd" or a.opd_rollouts == "student",
            f"algorithm.opd_rollouts ({a.opd_rollouts}) picks who samples opd's training responses; {a.name} samples "
            f"from the actor: leave it at student")
    if a.name == "armor":
        require(r.actor_n == r.n_samples - 1,
                f"rollout.actor_n must be rollout.n_samples - 1 = {r.n_samples - 1} for armor (groups are actor_n "
                f"on-policy samples + 1 anchor), got {r.actor_n}")
        require(r.ref_n >= 1, f"rollout.ref_n must be >= 1 for armor, got {r.ref_n}")
    else:
        require(r.actor_n == r.n_samples,
                f"rollout.actor_n must equal rollout.n_samples ({r.n_samples}) for {a.name}, got {r.actor_n}")
        require(r.anchor_engine == "separate" and not r.cache_anchors,
                f"rollout.anchor_engine ({r.anchor_engine}) and rollout.cache_anchors ({r.cache_anchors}) apply to "
                f"armor's anchors; {a.name} samples none: leave them at separate / false")
    require(r.n_samples >= 2, f"rollout.n_samples must be >= 2 for group advantages, got {r.n_samples}")
    for name in ("temperature", "val_temperature"):
        require(getattr(r, name) >= 0, f"rollout.{name} must be >= 0, got {getattr(r, name)}")
    for name in ("top_p", "val_top_p"):
        require(0 < getattr(r, name) <= 1, f"rollout.{name} must be in (0, 1], got {getattr(r, name)}")
    require(cfg.reward.overlong_buffer <= r.max_new_tokens,
            f"reward.overlong_buffer ({cfg.reward.overlong_buffer}) must be <= rollout.max_new_tokens ({r.max_new_tokens})")
    require(t.train_batch_size % t.mini_batch_size == 0,
            f"train.mini_batch_size ({t.mini_batch_size}) must divide train.train_batch_size ({t.train_batch_size})")
    require(t.subspace_capture_step >= 0, f"train.subspace_capture_step must be >= 0, got {t.subspace_capture_step}")
    require(t.subspace_k >= 1, f"train.subspace_k must be >= 1, got {t.subspace_k}")
    require(t.subspace_capture_step == 0 or t.subspace_mode == "gradient" or cfg.model.params_dtype == "float32",
            "train.subspace_mode update needs model.params_dtype float32 (with bf16 the optimizer steps fp32 copies)")
    dp = cfg.parallel.data_parallel_size
    require(t.mini_batch_size % dp == 0,
            f"train.mini_batch_size ({t.mini_batch_size}) must be divisible by parallel.data_parallel_size ({dp}) so "
            f"every data-parallel rank trains on the same number of prompts")
    require(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    require(t.grad_clip >= 0, f"train.grad_clip must be >= 0, got {t.grad_clip}")
    require(0 <= t.weight_decay, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    require(not r.release_memory or r.backend == "sglang",
            "rollout.release_memory hands GPU memory between SGLang servers and the trainer: it needs rollout.backend sglang")
    if r.backend == "sglang":
        require(bool(r.sglang_urls), "rollout.sglang_urls is required with rollout.backend sglang (e.g. http://host:30000)")
        require(a.name != "armor" or r.anchor_engine == "shared" or bool(r.sglang_ref_urls),
                "rollout.sglang_ref_urls is required for armor with rollout.backend sglang (servers of the reference "
                "policy), or set rollout.anchor_engine shared to sample anchors from the actor's servers")
        require(r.engine_precision == "fp32",
                f"rollout.engine_precision {r.engine_precision} simulates mismatch in the local engine only; set it to fp32 "
                f"with rollout.backend sglang (quantize the SGLang server itself instead)")
        require(r.sglang_update_bucket_mb >= 1, f"rollout.sglang_update_bucket_mb must be >= 1, got {r.sglang_update_bucket_mb}")
        require(r.weight_sync != "disk" or bool(r.weight_sync_dir),
                "rollout.weight_sync disk needs rollout.weight_sync_dir (a directory the SGLang servers can read)")
        router_urls = {name: getattr(r, name) for name in ("sglang_router_url", "sglang_ref_router_url") if getattr(r, name)}
        require(r.router != "none" or not router_urls,
                f"rollout.router is none but {', '.join(router_urls)} is set: drop it, or set rollout.router auto")
        require(not r.sglang_ref_router_url or bool(r.sglang_ref_urls),
                f"rollout.sglang_ref_router_url ({r.sglang_ref_router_url}) needs rollout.sglang_ref_urls, the servers "
                f"behind it (weight updates go to them directly)")
    else:
        require(not (r.sglang_router_url or r.sglang_ref_router_url),
                "rollout.sglang_router_url / sglang_ref_router_url apply to rollout.backend sglang only")
    require(r.anchor_engine == "separate" or not r.sglang_ref_urls,
            f"rollout.sglang_ref_urls ({r.sglang_ref_urls}) is unused with rollout.anchor_engine shared (anchors come "
            f"from the actor's servers): drop it, or set rollout.anchor_engine separate")
    if cfg.task.synthetic is None:
        require(cfg.model.path is not None, "model.path is required (an HF checkpoint directory) unless task.synthetic is set")
        require(cfg.data.train_path is not None, "data.train_path is required unless task.synthetic is set")
    require(cfg.eval.max_prompts is None or cfg.eval.max_prompts >= 1,
            f"eval.max_prompts must be >= 1 or null, got {cfg.eval.max_prompts}")


def config_to_dict(cfg: ArmorConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def save_config(cfg: ArmorConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def config_hash(value: Any) -> str:
    """Stable short sha256 of a config section (dataclass) or plain JSON-able value."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]
