"""Llama 2 / 3.x (model_type llama): the plain family; Llama 3.x RoPE scaling is read by `models.hf_config`."""

from megatron_armor.models.families.base import ModelFamily
from megatron_armor.models.families.registry import register_family

LLAMA = register_family(ModelFamily(model_type="llama", config_class="LlamaConfig"))
