"""Model families, one module each: a `ModelFamily` says what an HF `model_type`'s config.json means (the
`ModelShape` fields it decides, and what it refuses), which transformers config class makes its tiny test
checkpoints, and the shapes of its public models that `armor plan` knows. Importing this package registers the
built-ins; `register_family` adds one from outside.

Adding a family that reuses the layer kinds built here (attention with or without q/k/v biases or q/k norms,
dense or routed SwiGLU MLPs, a shared expert, multi-latent attention) is one module here, imported below, plus its
tests.
"""

from megatron_armor.models.families import (  # noqa: F401 (register)
    deepseek_v3, glm4_moe, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe,
)
from megatron_armor.models.families.base import ModelConfigError, ModelFamily
from megatron_armor.models.families.moe import MoEFamily
from megatron_armor.models.families.registry import (
    known_shapes, model_family, register_family, registered_families, unregister_family,
)

__all__ = ["ModelConfigError", "ModelFamily", "MoEFamily", "known_shapes", "model_family", "register_family",
           "registered_families", "unregister_family"]
