"""Worker: where `load_gpt_model` puts a model: on `training_device()`, here the CPU, then (patched) meta.

argv: out_dir model_dir. Writes the devices of the parameters and buffers of each and Megatron's
`use_cpu_initialization`.
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

from megatron_armor.convert import loading  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape  # noqa: E402


def placement(model: torch.nn.Module) -> dict:
    tensors = [*model.parameters(), *model.buffers()]
    return {"devices": sorted({str(t.device) for t in tensors}), "cpu_init": model.config.use_cpu_initialization}


out_dir, model_dir = sys.argv[1:]
initialize_distributed(1, 1, 1)
shape = load_model_shape(model_dir)
result = {"cpu": placement(loading.load_gpt_model(model_dir, shape, trainable=True))}
loading.training_device = lambda: torch.device("meta")
result["meta"] = placement(loading.load_gpt_model(model_dir, shape, trainable=True))
write_result(out_dir, result)
destroy_distributed()
