"""`rollout`: the engine that samples responses, and its sub-sections: sampling, ARMOR's anchors, multi-turn
(agentic) rollouts, the settings
of each rollout backend (`local`, `sglang`: a backend's settings are the sub-section named after it), the weight
sync to the servers, and the GPU-memory hand-off with colocated servers.

The backends themselves (what builds the engines from these settings) are registered by name in
`megatron_armor.rollout.backends`; here a backend's sub-section checks the rules its backend needs
(`check_with`) and says whether its engines run in the trainer's processes (`in_process`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from megatron_armor.config.base import check_choices, doc, require, require_at_least, section
from megatron_armor.config.builders import Buildable


@dataclass
class SamplingConfig(Buildable):
    """Group sizes and sampling of training and validation rollouts."""

    component = "megatron_armor.rollout.base:sampling_params"

    n_samples: int = doc(16, "group size per prompt")
    actor_n: int | None = doc(
        None, "on-policy samples per prompt (unset: what the algorithm fixes it to: n_samples - 1 under armor, whose "
        "groups hold one anchor, n_samples otherwise; a set value must agree)"
    )
    temperature: float = doc(1.0, "sampling temperature of training rollouts")
    top_p: float = doc(1.0, "nucleus sampling of training rollouts")
    max_new_tokens: int = doc(8192, "maximum response length in tokens")
    val_temperature: float = doc(1.0, "sampling temperature of validation")
    val_top_p: float = doc(0.7, "nucleus sampling of validation")
    val_n: int = doc(1, "samples per validation prompt")

    def __post_init__(self) -> None:
        require_at_least("rollout.sampling", self, ("n_samples", "max_new_tokens", "val_n"), 1)
        if self.actor_n is not None:
            require_at_least("rollout.sampling", self, ("actor_n",), 1)
        require(self.n_samples >= 2,
                f"rollout.sampling.n_samples must be >= 2 for group advantages, got {self.n_samples}")
        for name in ("temperature", "val_temperature"):
            require(getattr(self, name) >= 0, f"rollout.sampling.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("top_p", "val_top_p"):
            require(0 < getattr(self, name) <= 1,
                    f"rollout.sampling.{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass
class AnchorsConfig(Buildable):
    """ARMOR's anchors: samples of the reference policy mixed into each group."""

    component = "megatron_armor.trainer.rollouts.anchor_cache:anchor_cache"

    ref_n: int = doc(4, "anchor samples per prompt from the reference policy (ARMOR)")
    engine: Literal["separate", "shared"] = doc(
        "separate", "engine of ARMOR's anchors: separate (the reference's own: an in-process copy, or "
        "rollout.sglang.ref_urls) | shared (the actor's engine; the reference's weights are pushed in before an "
        "anchor phase and the actor's pushed back before on-policy sampling)"
    )
    cache: bool = doc(
        False, "reuse a prompt's anchors (key: its prompt token ids) at later steps until the reference is reset, "
        "instead of regenerating them every step as ARMOR does; the cache is saved in checkpoints"
    )
    cache_max_prompts: int = doc(
        4096, "prompts the anchor cache holds (least recently used evicted first); each holds ref_n anchors "
        "(token ids + logprobs: tens of bytes per token, in memory and in trainer_state.json)"
    )

    def __post_init__(self) -> None:
        check_choices("rollout.anchors", self)
        require_at_least("rollout.anchors", self, ("cache_max_prompts",), 1)


STATUS_ACTIONS = ("train", "zero_reward", "resample")  # what rollout.agentic.on_<status> may say


@dataclass
class AgenticConfig(Buildable):
    """Multi-turn, tool-using rollouts (docs/guides/agentic.md): with an environment or a rollout function (set one
    of them), every training sample (and ARMOR's anchor, sampled by the reference the same way) is a
    trajectory."""

    component = "megatron_armor.trainer.rollouts.trajectories:TrajectoryScorer.load"

    environment: str | None = doc(
        None, "the environment class (package.module:Class or path/to/file.py:Class, a subclass of "
        "megatron_armor.agentic.environment.Environment) whose trajectories the policy trains on; null: one "
        "completion per sample (unless rollout_fn is set)"
    )
    rollout_fn: str | None = doc(
        None, "instead of an environment, a rollout function of one's own (package.module:function or "
        "path/to/file.py:function): `async def rollout(ctx: RolloutContext, row: dict) -> Trajectory` "
        "(megatron_armor.agentic.driver), which samples with ctx.generate and scores its trajectory itself"
    )
    chat_template: str | None = doc(
        None, "a Jinja chat-template file rendering the conversations (null: the tokenizer's own chat_template)"
    )
    end_of_turn: str | None = doc(
        None, "the token that ends an assistant turn (the policy's stop token in trajectories, e.g. <|im_end|>); "
        "null: the tokenizer's EOS"
    )
    max_turns: int = doc(8, "policy turns per trajectory (truncated after)")
    max_total_tokens: int = doc(
        4096, "tokens of a trajectory (prompt, turns, tool results; truncated when spent); each turn samples at most "
        "rollout.sampling.max_new_tokens"
    )
    max_invalid_turns: int = doc(3, "invalid turns in a row (e.g. malformed tool calls) before a trajectory aborts")
    max_in_flight: int = doc(64, "trajectories a rank runs at once (one asyncio task each)")
    on_completed: Literal["train", "zero_reward", "resample"] = doc(
        "train", "what a trajectory that the environment ended becomes: train (its reward, the policy's tokens "
        "trained) | zero_reward (trained with reward 0, never correct) | resample (dropped, the row rolled out again)"
    )
    on_truncated: Literal["train", "zero_reward", "resample"] = doc(
        "train", "the same for a trajectory a limit ended (turns, tokens, a turn cut at its token limit)"
    )
    on_aborted: Literal["train", "zero_reward", "resample"] = doc(
        "zero_reward", "the same for one the engine interrupted or that made max_invalid_turns invalid turns in a row"
    )
    on_failed: Literal["train", "zero_reward", "resample"] = doc(
        "zero_reward", "the same for one whose environment or tool raised or timed out (the error is logged once)"
    )
    max_resamples: int = doc(
        2, "rollouts again of a row whose trajectory an on_<status> resample dropped (or that sampled nothing); past "
        "them the last one is trained with reward 0"
    )
    on_drift: Literal["keep", "fork"] = doc(
        "keep", "what a trajectory does when the chat template's render of the conversation differs from its tokens "
        "before the last sampled one (the template rewrote history, e.g. stripped earlier <think> reasoning): keep "
        "(one sample, token-exact: the policy keeps seeing its own earlier tokens) | fork (a new sample from the "
        "template's render, as the policy sees it at inference: Qwen 3's practice; each sample carries the "
        "trajectory's reward and advantage, and the trajectory counts once in its group)"
    )

    def __post_init__(self) -> None:
        check_choices("rollout.agentic", self)
        require(self.environment is None or self.rollout_fn is None,
                f"rollout.agentic.environment ({self.environment}) and rollout.agentic.rollout_fn ({self.rollout_fn}) "
                f"are two ways to roll a trajectory out: set one of them")
        require_at_least("rollout.agentic", self, ("max_turns", "max_total_tokens", "max_invalid_turns",
                                                   "max_in_flight"), 1)
        require_at_least("rollout.agentic", self, ("max_resamples",), 0)

    @property
    def rolls_out(self) -> bool:
        """Whether samples are trajectories: an environment or a rollout function is named."""
        return self.environment is not None or self.rollout_fn is not None

    def action(self, status: str) -> str:
        """What a trajectory ending in `status` (an agentic `Status` value) becomes: one of STATUS_ACTIONS."""
        return getattr(self, f"on_{status}")


@dataclass
class LocalEngineConfig(Buildable):
    """Backend local: an in-process HF model per policy on every trainer rank; it builds one such engine."""

    component = "megatron_armor.rollout.local:LocalEngine.load"

    in_process: ClassVar[bool] = True  # its engines live in the trainer's processes

    engine_precision: Literal["fp32", "bf16", "fp8"] = doc(
        "fp32", "weights of the local engine rounded to fp32 | bf16 | fp8 (simulated e4m3, per-row scale): the "
        "training/inference mismatch of production engines"
    )

    def __post_init__(self) -> None:
        check_choices("rollout.local", self)

    def check_with(self, rollout: RolloutConfig) -> None:
        """The SGLang-only settings of `rollout` stay unset."""
        require(not (rollout.sglang.router_url or rollout.sglang.ref_router_url),
                "rollout.sglang.router_url / ref_router_url apply to rollout.backend sglang only")
        require(not rollout.memory.release_servers,
                "rollout.memory.release_servers hands GPU memory between SGLang servers and the trainer: it needs "
                "rollout.backend sglang")


@dataclass
class SGLangClientConfig(Buildable):
    """Backend sglang: the SGLang servers the trainer talks to and how requests are dispatched over them; it builds
    the client of one policy's servers (with the router it starts when one is wanted)."""

    component = "megatron_armor.rollout.backends:sglang_client"

    in_process: ClassVar[bool] = False  # its engines are clients of servers

    urls: str | None = doc(None, "comma-separated URLs of the actor's SGLang servers (backend sglang)")
    ref_urls: str | None = doc(
        None, "comma-separated URLs of the reference policy's servers (ARMOR anchors, rollout.anchors.engine separate)"
    )
    router: Literal["auto", "sglang", "none"] = doc(
        "auto", "dispatch of generation requests over the SGLang servers (backend sglang): auto (SGLang's router "
        "for 2+ servers when the sglang_router package is installed, else the client's least-loaded dispatcher) | sglang (the "
        "router; an error if it is not installed) | none (the client's dispatcher). Weight updates, flushes and "
        "health checks go to every server directly either way"
    )
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = doc(
        "cache_aware", "load-balancing policy of SGLang's router (sglang_router --policy)"
    )
    router_url: str | None = doc(
        None, "URL of a running SGLang router in front of urls (armor ray-train sets it); unset: each trainer "
        "process starts its own router on loopback when rollout.sglang.router picks one"
    )
    ref_router_url: str | None = doc(None, "the same for ref_urls")

    def __post_init__(self) -> None:
        check_choices("rollout.sglang", self)
        router_urls = [f"rollout.sglang.{name}" for name in ("router_url", "ref_router_url") if getattr(self, name)]
        require(self.router != "none" or not router_urls,
                f"rollout.sglang.router is none but {', '.join(router_urls)} is set: drop it, or set "
                f"rollout.sglang.router auto")
        require(not self.ref_router_url or bool(self.ref_urls),
                f"rollout.sglang.ref_router_url ({self.ref_router_url}) needs rollout.sglang.ref_urls, the servers "
                f"behind it (weight updates go to them directly)")

    def check_with(self, rollout: RolloutConfig) -> None:
        """The servers are named, the local engine's simulated precision is off, and a disk weight sync has its
        directory."""
        require(bool(self.urls), "rollout.sglang.urls is required with rollout.backend sglang (e.g. http://host:30000)")
        precision = rollout.local.engine_precision
        require(precision == "fp32",
                f"rollout.local.engine_precision {precision} simulates mismatch in the local engine only; set it to "
                f"fp32 with rollout.backend sglang (quantize the SGLang server itself instead)")
        require(rollout.weight_sync.method != "disk" or bool(rollout.weight_sync.dir),
                "rollout.weight_sync.method disk needs rollout.weight_sync.dir (a directory the SGLang servers can "
                "read)")


@dataclass
class WeightSyncConfig(Buildable):
    """How the trainer's weights reach the SGLang servers (backend sglang); it builds an SGLang client's weight
    transport (rollout/weight_transport.py)."""

    component = "megatron_armor.rollout.weight_transport:weight_transport"

    method: Literal["tensor", "distributed", "disk"] = doc(
        "tensor", "how weights reach the SGLang servers (backend sglang): tensor = /update_weights_from_tensor with "
        "shared-memory / CUDA-IPC handles, for servers on the trainer ranks' hosts (colocated: each host's servers get "
        "the weights from that host's ranks); distributed = a process "
        "group with the servers and /update_weights_from_distributed broadcasts (gloo on CPU, nccl on GPU), for "
        "servers on other hosts (disaggregated); disk = safetensors files (one per bucket) in a fresh subdirectory "
        "of dir and /update_weights_from_disk (fallback)"
    )
    dir: str | None = doc(None, "directory the servers can read, for method disk")
    payload: Literal["flattened_bucket", "per_tensor"] = doc(
        "flattened_bucket", "payload of methods tensor and distributed: flattened_bucket = each bucket packed into "
        "one buffer, sent as one handle or broadcast (SGLang's load_format flattened_bucket); per_tensor = SGLang's "
        "load_format null: method tensor sends tensors the servers can map where they are as handles to the "
        "trainer's own storage, with no staging copy (every CUDA tensor; on CPU the weights the push reads in place, "
        "which each pushing rank then keeps in shared memory unless rollout.memory.offload_trainer), the rest (on "
        "CPU: TP-gathered, split fused QKV) staged; method distributed broadcasts tensor by tensor"
    )
    bucket_mb: float = doc(512, "weight-update bucket size in MiB (backend sglang)")

    def __post_init__(self) -> None:
        check_choices("rollout.weight_sync", self)
        require(self.bucket_mb > 0, f"rollout.weight_sync.bucket_mb must be > 0, got {self.bucket_mb}")

    @property
    def bucket_bytes(self) -> int:
        """Weights per update request in bytes (bucket_mb; slime's --update-weight-buffer-size)."""
        return int(self.bucket_mb * (1 << 20))

    @property
    def load_format(self) -> Literal["flattened_bucket"] | None:
        """SGLang's load_format of a push: None (tensor by tensor) for payload per_tensor, else flattened_bucket."""
        return None if self.payload == "per_tensor" else "flattened_bucket"


@dataclass
class MemoryHandoffConfig(Buildable):
    """Sharing GPUs between the trainer and colocated rollout servers."""

    component = "megatron_armor.trainer.colocation.memory_handoff:memory_handoff"

    release_servers: bool = doc(
        False, "servers on the trainer's GPUs (colocated; started with --enable-memory-saver) release their GPU memory "
        "while the trainer computes and take it back before each weight push (backend sglang; armor ray-train "
        "--placement colocated sets it)"
    )
    offload_trainer: bool = doc(
        False, "the trainer's weights, optimizer state and grad buffers leave the GPU for host memory while the "
        "rollout servers generate (the actor's weights come back after each update for the push, the MIPU gate and "
        "validation), so colocated servers fit beside it; costs about two host-device copies of them per step and "
        "that much page-locked host memory (armor ray-train --placement colocated sets it; on CPU it saves nothing)"
    )


@dataclass
class RolloutConfig(Buildable):
    """How responses are generated: the backend (its settings in the sub-section named after it), sampling, ARMOR's
    anchors, multi-turn rollouts, weight pushes and the GPU memory shared with servers; it builds the rank's on-policy
    and anchor engines."""

    component = "megatron_armor.rollout.backends:rollout_engines"

    backend: Literal["local", "sglang"] = doc(
        "local", "rollout backend (megatron_armor.rollout.backends): local (in-process HF models; settings in "
        "rollout.local) | sglang (HTTP servers; settings in rollout.sglang)"
    )
    mode: Literal["sync", "one_step_off", "async"] = doc(
        "sync", "when rollouts run: sync (each step generates its own samples, then trains on them) | one_step_off "
        "(the samples of step t+1 are generated, from the weights before step t's update, while step t trains; the "
        "new weights are pushed once both are done: samples one weight version old, corrected by "
        "algorithm.behaviour_correction) | async (a background generator keeps rollout.async_buffer_batches "
        "generation batches ahead of the trainer; a weight push waits for the batch in flight only, and a step trains "
        "on batches at most rollout.max_staleness weight versions old, dropping older ones). The overlapped modes "
        "gain only where the engine has compute of its own (SGLang servers on other GPUs, or spare CPU cores): "
        "colocated placement (rollout.memory) refuses them"
    )
    max_staleness: int = doc(
        1, "rollout.mode async: the most weight versions (kept updates) a trained sample may lag the trainer's "
        "weights; older buffered batches are dropped (async/dropped_stale_groups)"
    )
    async_buffer_batches: int = doc(
        2, "rollout.mode async: generation batches the generator may be ahead of the trainer (the one generating "
        "included); more hides longer rollouts and holds more samples, which grow staler"
    )
    partial_rollouts: bool = doc(
        False, "rollout.mode async: a weight push interrupts the generations in flight (SGLang's abort; the local "
        "engine stops decoding) instead of waiting for them, and they continue afterwards from their partial "
        "responses under the new weights; every token keeps the weight version and engine logprob it was sampled "
        "with (async/partial_fraction: the share of trained samples that mix versions); a multi-turn trajectory's "
        "interrupted turn continues likewise, its later turns sampled by the weights the engine then holds"
    )
    sampling: SamplingConfig = section(SamplingConfig)
    anchors: AnchorsConfig = section(AnchorsConfig)
    agentic: AgenticConfig = section(AgenticConfig)
    local: LocalEngineConfig = section(LocalEngineConfig)
    sglang: SGLangClientConfig = section(SGLangClientConfig)
    weight_sync: WeightSyncConfig = section(WeightSyncConfig)
    memory: MemoryHandoffConfig = section(MemoryHandoffConfig)

    def __post_init__(self) -> None:
        """Rules between the backend, the mode and the sub-sections."""
        check_choices("rollout", self)
        s = self.sglang
        colocated = next((f"rollout.memory.{name}" for name in ("release_servers", "offload_trainer")
                          if getattr(self.memory, name)), None)
        require(self.mode == "sync" or colocated is None,
                f"rollout.mode {self.mode} overlaps generation with training, but {colocated} gives the GPU to one of "
                f"them at a time (colocated placement): use rollout.mode sync, or servers on GPUs of their own")
        require(self.mode == "sync" or self.anchors.engine == "separate",
                f"rollout.mode {self.mode} generates in a background thread, but rollout.anchors.engine shared "
                f"swaps the actor's and the reference's weights in the engine during a rollout, through collectives "
                f"of the trainer's process groups that the update uses at the same time: use rollout.anchors.engine "
                f"separate, or rollout.mode sync")
        require(not self.partial_rollouts or self.mode == "async",
                f"rollout.partial_rollouts continues generations a weight push interrupted, which only rollout.mode "
                f"async does (sync and one_step_off push weights while nothing generates): got mode {self.mode}")
        require_at_least("rollout", self, ("max_staleness",), 0)
        require_at_least("rollout", self, ("async_buffer_batches",), 1)
        self.backend_settings.check_with(self)
        require(self.anchors.engine == "separate" or not s.ref_urls,
                f"rollout.sglang.ref_urls ({s.ref_urls}) is unused with rollout.anchors.engine shared (anchors come "
                f"from the actor's servers): drop it, or set rollout.anchors.engine separate")

    @property
    def backend_settings(self) -> LocalEngineConfig | SGLangClientConfig:
        """The chosen backend's settings: the sub-section named after it (rollout.local, rollout.sglang)."""
        return getattr(self, self.backend)

    def check_with(self, routing_replay: str) -> None:
        """Partial rollouts mix weight versions within a response, which train.`routing_replay` rollout cannot
        replay; trajectories do not record the engine's routes."""
        require(not self.partial_rollouts or routing_replay != "rollout",
                "rollout.partial_rollouts continues a response under new weights, which route the tokens they re-read "
                "otherwise than the weights that sampled them: train.routing_replay rollout (R3) would replay a mix "
                "of both; use routing_replay recompute (R2) or none with partial rollouts")
        require(not self.agentic.rolls_out or routing_replay != "rollout",
                "rollout.agentic.environment / rollout_fn: trajectories do not record the engine's routes, which "
                "train.routing_replay rollout (R3) replays; use routing_replay recompute (R2) or none with multi-turn "
                "rollouts")
