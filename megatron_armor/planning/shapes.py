"""The model shape a plan uses: the HF config.json of a local checkpoint, else a built-in table of the shapes of
the models the recipes in examples/ name (public HF config.json values), so a layout can be planned on a machine
that has no checkpoint."""

from __future__ import annotations

from pathlib import Path

from megatron_armor.models.hf_config import ModelShape, load_model_shape, model_shape_from_dict

# name (matched case-insensitively against the checkpoint directory's name) -> the HF config.json fields a
# ModelShape needs. Longest names first, so "qwen3-8b-base" is not read as another model.
KNOWN_SHAPES: dict[str, dict] = {
    "qwen2.5-math-7b": {  # Qwen/Qwen2.5-Math-7B
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
    "qwen3-8b-base": {  # Qwen/Qwen3-8B-Base
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 routed per token, every layer MoE
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "qwen3-1.7b": {  # Qwen/Qwen3-1.7B
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    },
    "synthetic-tiny": {  # models/tiny.py make_tiny_checkpoint's defaults (the synthetic task's model)
        "model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
}


def resolve_model_shape(model_path: str | None) -> tuple[ModelShape, str]:
    """(shape, where it came from) of `model_path`: its config.json when it is a local directory, else the
    `KNOWN_SHAPES` entry whose name its last path component contains (None: the synthetic task's tiny model).
    Raises ValueError when neither applies."""
    if model_path is None:
        return model_shape_from_dict(KNOWN_SHAPES["synthetic-tiny"]), "built-in shape of the synthetic tiny model"
    if Path(model_path).is_dir():
        return load_model_shape(model_path), f"{model_path}/config.json"
    name = Path(model_path).name.lower()
    for known in sorted(KNOWN_SHAPES, key=len, reverse=True):
        if known in name:
            return model_shape_from_dict(KNOWN_SHAPES[known]), (
                f"built-in shape of {known} ({model_path} is not a local directory)")
    raise ValueError(f"model.path {model_path} is not a local checkpoint directory and names none of the known "
                     f"models {sorted(KNOWN_SHAPES)}: pass a directory with the model's config.json")
