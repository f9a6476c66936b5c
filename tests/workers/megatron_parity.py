"""Worker: Megatron GPTModel vs HF forward, vocab-parallel logprobs, engine vs trainer logprobs.

argv: out_dir model_dir... (each model checked in turn; results keyed by model_dir)
"""

import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

from megatron_armor.config import MicroBatchingConfig  # noqa: E402
from megatron_armor.convert.weights import gather_hf_weights, load_hf_weights, parameters_exported_as_views  # noqa: E402
from megatron_armor.data.types import Sample  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.models.gpt import PADDED_VOCAB_LOGIT, build_gpt_model  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape, transformer_config  # noqa: E402
from megatron_armor.rollout.base import SamplingParams  # noqa: E402
from megatron_armor.rollout.local import LocalEngine  # noqa: E402
from megatron_armor.scoring.batch import build_sequence_batch  # noqa: E402
from megatron_armor.scoring.logprobs import ScoringConfig, compute_logprobs  # noqa: E402
from megatron_armor.scoring.micro_batches import MicroBatching  # noqa: E402

out_dir, *model_dirs = sys.argv[1:]
world = int(__import__("os").environ["WORLD_SIZE"])
ctx = initialize_distributed(world, 1, seed=0)


def check(model_dir: str) -> dict:
    shape = load_model_shape(model_dir)
    model = build_gpt_model(shape, transformer_config(shape, tp_size=ctx.tp_size), trainable=False)
    load_hf_weights(model, model_dir, shape)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    # 1. Forward parity: this rank's vocab shard of the logits equals the HF logits' slice; padded
    #    vocabulary columns (beyond the HF vocab) hold the mask value.
    ids = torch.randint(0, shape.vocab_size, (3, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, torch.arange(13).expand(3, -1), None)
        ref = hf(ids).logits
    shard = shape.padded_vocab_size // ctx.tp_size
    first, real = ctx.tp_rank * shard, max(0, min(shard, shape.vocab_size - ctx.tp_rank * shard))
    forward_diff = (logits[..., :real] - ref[..., first : first + real]).abs().max().item() if real else 0.0
    padding_masked = bool((logits[..., real:] == PADDED_VOCAB_LOGIT).all())

    # 2. Logprobs of engine samples through the schedule vs the engine's own sampling logprobs.
    engine = LocalEngine(model_dir)
    prompts = [[5, 17, 30], [40, 41, 42, 43, 44], [7]]
    gens = engine.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=9, seed=3))
    samples = [Sample(i, g.prompt_ids, g.response_ids, g.logprobs, g.finish_reason, False) for i, g in enumerate(gens)]
    batch = build_sequence_batch(samples, [0.0] * len(samples), pad_token_id=0)
    trainer = compute_logprobs(model, batch, micro_batching=MicroBatching(MicroBatchingConfig(2)),
                               scoring=ScoringConfig(temperature=0.8, with_entropy=True))
    mask = batch.response_mask.bool()
    engine_diff = (trainer.logprobs - batch.engine_logprobs)[mask].abs().max().item()
    with torch.no_grad():
        full = torch.log_softmax(hf(batch.input_ids).logits / 0.8, dim=-1)
    hf_logprobs = full.gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    hf_entropy = -(full.exp() * full).sum(-1)
    logprob_diff = (trainer.logprobs - hf_logprobs)[mask].abs().max().item()
    entropy_diff = (trainer.entropy - hf_entropy)[mask].abs().max().item()

    # 3. TP-gathered export reproduces the HF state dict exactly.
    exported = dict(gather_hf_weights(model, shape))
    hf_state = dict(hf.named_parameters())  # tied lm_head appears once, as embed_tokens
    export_diff = max((exported[k] - hf_state[k]).abs().max().item() for k in hf_state)
    # The exports that are views of a parameter are exactly those of parameters_exported_as_views.
    view_storages = {p.untyped_storage().data_ptr() for p in parameters_exported_as_views(model, shape)}
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exported_storages = {t.untyped_storage().data_ptr() for t in exported.values()}
    views_match = exported_storages & param_storages == view_storages
    return {
        "forward_diff": forward_diff, "padding_masked": padding_masked, "engine_diff": engine_diff,
        "logprob_diff": logprob_diff, "entropy_diff": entropy_diff, "export_diff": export_diff,
        "export_keys_match": set(exported) == set(hf_state),
        "views_match": views_match, "views": len(view_storages), "logprobs": trainer.logprobs[mask].tolist(),
    }


write_result(out_dir, {model_dir: check(model_dir) for model_dir in model_dirs})
destroy_distributed()
