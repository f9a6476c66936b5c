"""`ModelShape`: the architecture facts of a model that its family read from config.json, which the weight
mapping, the layer specs, Megatron's `TransformerConfig` and the planner all build from."""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_PADDING_MULTIPLE = 128  # Megatron vocab = HF vocab rounded up to this; independent of TP, so
# a checkpoint saved at one tensor-parallel size loads at any size that divides the padded vocab.


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention (DeepSeek-V2/V3; Megatron's `MLASelfAttention`): per token, queries come from a
    `q_lora_rank`-wide latent (RMSNorm, then up-projected to every head's `qk_nope_head_dim + qk_rope_head_dim`
    dims) and keys and values from one `kv_lora_rank`-wide latent (RMSNorm, then up-projected to every head's
    `qk_nope_head_dim` key dims and `v_head_dim` value dims) plus one `qk_rope_head_dim`-wide rotary key shared by the
    heads (decoupled RoPE, on interleaved pairs of dims). RoPE is plain (`yarn_factor` None) or YaRN-scaled: `factor`
    over `original_max_position_embeddings`, ramp `beta_fast` / `beta_slow`, cos/sin scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax by mscale(factor, mscale_all_dim)^2
    (mscale(s, m) = 0.1 m ln s + 1)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0

    @property
    def q_head_dim(self) -> int:
        """A query's (and key's) dims per head: the position-free ones, then the rotary ones."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts both the HF and the Megatron side need (decoder-only, RoPE, SwiGLU)."""

    arch: str  # the HF model_type, whose `models.families` entry read the config
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys
    rope_scaling_factor: float | None = None  # Llama 3.x RoPE scaling factor (None: unscaled)
    rotary_percent: float = 1.0  # the share of head_dim RoPE rotates (its first dims, rotate-half), GLM-4.5: 0.5
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE): 0 experts is a dense model. A MoE layer routes each token to the
    # `moe_top_k` of `num_experts` SwiGLU experts of width `moe_ffn_hidden_size` with a softmax router (its top-k
    # probabilities renormalised to sum 1 when `norm_topk_prob`); `dense_layers` (global indices) keep a dense MLP
    # of width `ffn_hidden_size` (HF's `mlp_only_layers` and the layers `decoder_sparse_step` skips). Qwen2-MoE adds
    # to every MoE layer a shared SwiGLU expert of width `shared_expert_ffn_hidden_size` (0: none) that every token
    # passes through, its output scaled by sigmoid(x . g) of a learned gate vector g [hidden].
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    shared_expert_ffn_hidden_size: int = 0
    # GLM-4.5's and DeepSeek-V3's sigmoid router (`families.sigmoid_moe`): per-expert sigmoid scores; the top k are #
    # chosen by score plus a fixed per-expert correction bias (`expert_bias`, HF's e_score_correction_bias) among the #
    # experts of the `router_group_topk` best of `router_groups` equal groups (a group's merit: its two best biased
    # scores), their # unbiased scores renormalised to sum 1, then multiplied by `routed_scaling_factor`.
    expert_bias: bool = False
    router_groups: int = 1
    router_group_topk: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-token-prediction layers the HF checkpoint holds after its decoder layers (num_nextn_predict_layers,
    # `model.layers.{num_layers + i}.*`): not built or trained, their tensors carried through conversion verbatim.
    mtp_layers: int = 0
    # Multi-latent attention in place of standard attention (DeepSeek-V3): its ranks and head dims (`MLAShape`);
    # `num_kv_heads` is then `num_attention_heads` and `head_dim` unused.
    mla: MLAShape | None = None

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global decoder layer `layer` has routed experts (else a dense SwiGLU MLP)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def padded_vocab_size(self) -> int:
        """Megatron's vocabulary: `vocab_size` rounded up to a multiple of 128 (extra rows are masked)."""
        return -(-self.vocab_size // VOCAB_PADDING_MULTIPLE) * VOCAB_PADDING_MULTIPLE
