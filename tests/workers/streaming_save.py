"""Worker: `StreamingSaveStrategy` builds each parameter only when the writer reaches it, and frees it.

argv: out_dir HF_DIR   (run on 1 rank)
Writes {"calls": materialise calls, "params": parameter count, "most_alive": the most earlier values
still alive when a new one was built, "max_diff": max |loaded - HF-loaded| over the parameters}.
"""

import sys
import weakref

import torch

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

from megatron_armor.convert.megatron_checkpoint import load_megatron_weights, save_model_checkpoint  # noqa: E402
from megatron_armor.convert.streaming_save import StreamingSaveStrategy  # noqa: E402
from megatron_armor.convert.weights import hf_parameter_source, load_hf_weights  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.models.gpt import build_gpt_model  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape, transformer_config  # noqa: E402

out_dir, hf_dir = sys.argv[1], sys.argv[2]
initialize_distributed(1, 1, 1)
shape = load_model_shape(hf_dir)
config = transformer_config(shape, params_dtype=torch.float32)
with torch.device("meta"):
    meta_model = build_gpt_model(shape, config, trainable=False)

source = hf_parameter_source(meta_model, hf_dir, shape)
built: list[weakref.ref] = []
most_alive = 0


def tracked(name: str) -> torch.Tensor:
    global most_alive
    most_alive = max(most_alive, sum(ref() is not None for ref in built))
    value = source(name)
    built.append(weakref.ref(value))
    return value


save_model_checkpoint(meta_model, shape, f"{out_dir}/ckpt", side_files_from=hf_dir,
                      strategy=StreamingSaveStrategy(meta_model, tracked))
loaded, reference = (build_gpt_model(shape, config, trainable=False) for _ in range(2))
load_megatron_weights(loaded, f"{out_dir}/ckpt")
load_hf_weights(reference, hf_dir, shape)
max_diff = max((a - b).abs().max().item() for a, b in zip(loaded.parameters(), reference.parameters()))
write_result(out_dir, {"calls": len(built), "params": len(list(meta_model.parameters())), "most_alive": most_alive,
                       "max_diff": max_diff})
destroy_distributed()
