"""HF safetensors checkpoint -> Megatron distributed checkpoint, written by tp x pp processes (x the data-parallel
ranks a MoE model's expert layout needs).

`convert_hf_to_megatron` (one process) validates the input and output, launches
`python -m megatron_armor.convert.cli hf-to-megatron ...` again under torchrun, and publishes the
result; in each of those tp x pp ranks `write_megatron_shards` builds its pipeline stage and TP
shard on the meta device (no storage) and streams it into Megatron's `dist_checkpointing` format:
each parameter's TP shard is read from the safetensors files (only its rows / columns of the HF
tensors, `hf_shard_index`), assembled and written when the writer reaches it, so a rank holds one
parameter shard at a time, never its whole shard of the model.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_armor.config import expert_tp_size
from megatron_armor.convert import workers
from megatron_armor.convert.carried import save_carried_tensors
from megatron_armor.convert.hf_inputs import inspect_hf_checkpoint
from megatron_armor.convert.megatron_checkpoint import dtype_name, is_megatron_checkpoint, save_model_checkpoint
from megatron_armor.convert.output_dir import check_output_dir, staged_output, staging_dir
from megatron_armor.convert.streaming_save import StreamingSaveStrategy
from megatron_armor.convert.weights import hf_parameter_source
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed
from megatron_armor.models.gpt import build_gpt_model
from megatron_armor.models.hf_config import check_parallel_layout, transformer_config


def convert_hf_to_megatron(
    hf_dir: str | Path, out: str | Path, *, tp: int, pp: int, ep: int = 1, etp: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert `hf_dir` to a Megatron checkpoint at `out` saved at layout tp x pp (experts of a MoE model over
    `ep` expert-parallel ranks, each expert's matrices over `etp` expert-TP ranks, None: tp); returns `out`.

    1 x 1 x 1 runs here, initialising (and tearing down) a one-process torch.distributed group: call it
    outside torchrun. Larger layouts launch tp x pp x `_writer_data_parallel_size` processes under torchrun, one rank
    each. Every check runs before anything is written; on failure nothing is left at `out` (an existing
    checkpoint there is only replaced, with `overwrite`, once the new one is complete).
    """
    etp = expert_tp_size(tp, etp)
    summary = inspect_hf_checkpoint(hf_dir)
    dtype_name(summary.dtype)  # refuses a dtype the model cannot be built in
    check_parallel_layout(summary.shape, tp, pp, ep, etp)
    check_output_dir(out, overwrite=overwrite, is_checkpoint=is_megatron_checkpoint, kind="Megatron")
    nproc = tp * pp * _writer_data_parallel_size(tp, ep, etp)
    with staged_output(out):
        if nproc == 1:
            write_megatron_shards(hf_dir, out, tp=1, pp=1)
        else:
            workers.run_conversion_workers(
                nproc, ["hf-to-megatron", "--hf-path", str(hf_dir), "--out", str(out), "--tp", str(tp),
                        "--pp", str(pp), "--ep", str(ep), "--etp", str(etp), "--worker"],
                failure=f"converting {hf_dir} failed in a worker process (output above); nothing written to {out}",
            )
    return Path(out)


def _writer_data_parallel_size(tp: int, ep: int, etp: int) -> int:
    """The fewest data-parallel ranks that hold experts over `ep` x `etp` (expert TP) ranks at TP `tp`: expert TP x EP
    must divide TP x DP at CP 1 (`config.check_expert_layout`), so DP = lcm(tp, etp x ep) / tp (ep when etp = tp, 1 when
    etp x ep divides tp)."""
    return math.lcm(tp, etp * ep) // tp


def write_megatron_shards(
    hf_dir: str | Path, out: str | Path, *, tp: int, pp: int, ep: int = 1, etp: int | None = None
) -> None:
    """This rank's part of the conversion, into `staging_dir(out)`; collective over tp x pp x
    `_writer_data_parallel_size` ranks (the data-parallel ranks write the shared weights once, and their experts'
    shards as Megatron's expert layout gives them out: each expert-parallel and expert-TP rank its own)."""
    etp = expert_tp_size(tp, etp)
    summary = inspect_hf_checkpoint(hf_dir)
    shape, staging = summary.shape, staging_dir(out)
    initialize_distributed(tp, pp, _writer_data_parallel_size(tp, ep, etp), expert_parallel_size=ep,
                           expert_tensor_parallel_size=etp)
    try:
        config = transformer_config(shape, tp_size=tp, pp_size=pp, params_dtype=summary.dtype, ep_size=ep, etp_size=etp)
        with torch.device("meta"):
            model = build_gpt_model(shape, config, trainable=False)
        model.to("meta")  # Megatron's routers allocate their buffers (an expert bias) on an explicit device
        strategy = StreamingSaveStrategy(model, hf_parameter_source(model, hf_dir, shape))
        if dist.get_rank() == 0:  # before the info file that marks the checkpoint complete
            save_carried_tensors(hf_dir, shape, staging)
        save_model_checkpoint(model, shape, staging, side_files_from=hf_dir, strategy=strategy)
    finally:
        destroy_distributed()
