"""`ModelShape`: the architecture facts of a model that its family read from config.json, which the weight
mapping, the layer specs, Megatron's `TransformerConfig` and the planner all build from."""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_PADDING_MULTIPLE = 128  # Megatron vocab = HF vocab rounded up to this; independent of TP, so
# a checkpoint saved at one tensor-parallel size loads at any size that divides the padded vocab.


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
    # GLM-4.5's sigmoid router (its family's `router_fields`): per-expert sigmoid scores; the top k are chosen by score
    # plus a fixed per-expert correction bias (`expert_bias`, HF's e_score_correction_bias) among the experts of the
    # `router_group_topk` best of `router_groups` equal groups (a group's merit: its two best biased scores), their
    # unbiased scores renormalised to sum 1, then multiplied by `routed_scaling_factor`.
    expert_bias: bool = False
    router_groups: int = 1
    router_group_topk: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-token-prediction layers the HF checkpoint holds after its decoder layers (GLM's num_nextn_predict_layers,
    # `model.layers.{num_layers + i}.*`): not built or trained, their tensors carried through conversion verbatim.
    mtp_layers: int = 0

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
