"""HF safetensors checkpoint -> Megatron distributed checkpoint, written by tp x pp processes.

`convert_hf_to_megatron` (one process) validates the input and output, launches
`python -m megatron_armor.convert.cli hf-to-megatron ...` again under torchrun, and publishes the
result; in each of those tp x pp ranks `write_megatron_shards` builds its pipeline stage and TP
shard on the meta device (no storage) and streams it into Megatron's `dist_checkpointing` format:
each parameter's TP shard is read from the safetensors files (only its rows / columns of the HF
tensors, `hf_shard_index`), assembled and written when the writer reaches it, so a rank holds one
parameter shard at a time, never its whole shard of the model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_armor.convert.hf_inputs import inspect_hf_checkpoint
from megatron_armor.convert.megatron_checkpoint import dtype_name, is_megatron_checkpoint, save_model_checkpoint
from megatron_armor.convert.output_dir import check_output_dir, staged_output, staging_dir
from megatron_armor.convert.streaming_save import StreamingSaveStrategy
from megatron_armor.convert.weights import hf_parameter_source
from megatron_armor.convert.workers import run_conversion_workers
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import check_parallel_layout, transformer_config


def convert_hf_to_megatron(
    hf_dir: str | Path, out: str | Path, *, tp: int, pp: int, ep: int = 1, overwrite: bool = False
) -> Path:
    """Convert `hf_dir` to a Megatron checkpoint at `out` saved at layout tp x pp (experts of a MoE model over
    `ep` expert-parallel ranks, each writing its own); returns `out`.

    1 x 1 x 1 runs here, initialising (and tearing down) a one-process torch.distributed group: call it
    outside torchrun. Larger layouts launch tp x pp x ep processes under torchrun, one rank each.
    Every check runs before anything is written; on failure nothing is left at `out` (an existing
    checkpoint there is only replaced, with `overwrite`, once the new one is complete).
    """
    summary = inspect_hf_checkpoint(hf_dir)
    dtype_name(summary.dtype)  # refuses a dtype the model cannot be built in
    check_parallel_layout(summary.shape, tp, pp, ep)
    check_output_dir(out, overwrite=overwrite, is_checkpoint=is_megatron_checkpoint, kind="Megatron")
    with staged_output(out):
        if tp * pp * ep == 1:
            write_megatron_shards(hf_dir, out, tp=1, pp=1)
        else:
            run_conversion_workers(
                tp * pp * ep, ["hf-to-megatron", "--hf-path", str(hf_dir), "--out", str(out), "--tp", str(tp),
                               "--pp", str(pp), "--ep", str(ep), "--worker"],
                failure=f"converting {hf_dir} failed in a worker process (output above); nothing written to {out}",
            )
    return Path(out)


def write_megatron_shards(hf_dir: str | Path, out: str | Path, *, tp: int, pp: int, ep: int = 1) -> None:
    """This rank's part of the conversion, into `staging_dir(out)`; collective over tp x pp x ep ranks (the
    expert-parallel ranks are Megatron's data-parallel ones: they write the shared weights once, their experts each)."""
    summary = inspect_hf_checkpoint(hf_dir)
    shape, staging = summary.shape, staging_dir(out)
    initialize_distributed(tp, pp, ep, expert_parallel_size=ep)
    try:
        config = transformer_config(shape, tp_size=tp, pp_size=pp, params_dtype=summary.dtype, ep_size=ep)
        with torch.device("meta"):
            model = build_gpt_model(shape, config, trainable=False)
        strategy = StreamingSaveStrategy(model, hf_parameter_source(model, hf_dir, shape))
        save_model_checkpoint(model, shape, staging, side_files_from=hf_dir, strategy=strategy)
    finally:
        destroy_distributed()
