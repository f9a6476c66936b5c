"""The model shape a plan uses: the HF config.json of a local checkpoint, else the known shape of a public model
that the model families bring (`models.families.known_shapes`: the models the recipes in examples/ name among
them, public HF config.json values), so a layout can be planned on a machine that has no checkpoint."""

from __future__ import annotations

from pathlib import Path

from megatron_armor.models.families import known_shapes
from megatron_armor.models.hf_config import ModelShape, load_model_shape, model_shape_from_dict

# The synthetic task's model (models/tiny.py make_tiny_checkpoint's defaults); the registered families bring the
# shapes of their public models (`models.families.known_shapes`).
SYNTHETIC_TINY = {
    "model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 176, "max_position_embeddings": 256, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def resolve_model_shape(model_path: str | None) -> tuple[ModelShape, str]:
    """(shape, where it came from) of `model_path`: its config.json when it is a local directory, else the known
    shape (`models.families.known_shapes`) whose name its last path component contains, matched case-insensitively,
    longest names first, so "qwen3-8b-base" is not read as another model (None: the synthetic task's tiny model).
    Raises ValueError when neither applies."""
    if model_path is None:
        return model_shape_from_dict(SYNTHETIC_TINY), "built-in shape of the synthetic tiny model"
    if Path(model_path).is_dir():
        return load_model_shape(model_path), f"{model_path}/config.json"
    name, shapes = Path(model_path).name.lower(), known_shapes()
    for known in sorted(shapes, key=len, reverse=True):
        if known in name:
            return model_shape_from_dict(shapes[known]), (
                f"built-in shape of {known} ({model_path} is not a local directory)")
    raise ValueError(f"model.path {model_path} is not a local checkpoint directory and names none of the known "
                     f"models {sorted(shapes)}: pass a directory with the model's config.json")
