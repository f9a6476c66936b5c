"""OPD's off-policy variant (opd.rollouts teacher, opd.md §1) through the trainer (TP=2, 2 gloo
processes): a greedy teacher engine samples the training responses, and the student's r_t on them matches
the HF student and teacher; and the variant's config rules."""

import math
from pathlib import Path

import pytest
import torch
from launcher import run_workers
from transformers import AutoModelForCausalLM

from megatron_armor.algorithms import check_algorithm_config
from megatron_armor.config import ConfigError, load_config
from megatron_armor.models.tokenizer import load_tokenizer

CONFIG = str(Path(__file__).parents[2] / "examples" / "tiny" / "opd.yaml")
TEACHER_ROLLOUTS = ["opd.rollouts=teacher", "algorithm.clip_low=1.0", "algorithm.clip_high=1.0"]
MAX_NEW_TOKENS = 40  # examples/tiny/opd.yaml


def _greedy_continuation(model, prompt_ids: list[int], eos_token_id: int) -> list[int]:
    """The model's greedy response: one uncached forward per token, up to and including EOS."""
    ids = list(prompt_ids)
    for _ in range(MAX_NEW_TOKENS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == eos_token_id:
            break
    return ids[len(prompt_ids):]


def _response_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """[R] float64 log-softmax (temperature 1) of each response token given the tokens before it."""
    ids = torch.tensor(prompt_ids + response_ids)
    logprobs = torch.log_softmax(model(ids[None]).logits[0].double(), dim=-1)  # [L, V]
    positions = torch.arange(len(prompt_ids) - 1, len(ids) - 1)  # [R] the positions predicting the response
    return logprobs[positions, ids[positions + 1]]


@torch.no_grad()
def test_teacher_engine_samples_the_batch_and_r_t_matches_hf_models(synthetic_cache, tmp_path):
    ranks = run_workers(
        "opd_teacher_rollouts.py", 2, tmp_path / "w", CONFIG, *TEACHER_ROLLOUTS, f"task.cache_dir={synthetic_cache}",
        f"logging.run_dir={tmp_path / 'run'}", "task.num_train_rows=400", "task.num_val_rows=16",
        "rollout.sampling.top_p=1e-6",  # nucleus of the top token only: a greedy teacher, logprobs still at temperature 1
        "rollout.sampling.n_samples=2", "rollout.sampling.actor_n=2", "train.train_batch_size=4",
        "train.gen_batch_size=4", "train.mini_batch_size=2", "eval.every=0", "eval.before_train=false", "logging.tensorboard=false",
        "logging.plot=false",
    )
    result = ranks[0]
    assert ranks[1]["samples"] == result["samples"]
    student = AutoModelForCausalLM.from_pretrained(result["student_path"], dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(result["teacher_path"], dtype=torch.float32).eval()
    eos = load_tokenizer(result["student_path"]).eos_token_id

    samples = result["samples"]
    assert len(samples) == 8  # 4 prompts x 2 samples, none filtered
    log_ratios = []
    student_would_differ = 0
    for sample in samples:
        prompt, response = sample["prompt_ids"], sample["response_ids"]
        assert response == _greedy_continuation(teacher, prompt, eos)
        student_would_differ += response != _greedy_continuation(student, prompt, eos)
        old = _response_logprobs(student, prompt, response)  # pi_old: the student before the update
        scored = _response_logprobs(teacher, prompt, response)  # q_T
        trainer_old = torch.tensor(sample["old_logprobs"], dtype=torch.float64)
        trainer_teacher = torch.tensor(sample["teacher_logprobs"], dtype=torch.float64)
        torch.testing.assert_close(trainer_old, old, atol=1e-4, rtol=0)
        torch.testing.assert_close(trainer_teacher, scored, atol=1e-4, rtol=0)
        torch.testing.assert_close(trainer_old - trainer_teacher, old - scored, atol=1e-4, rtol=0)
        # pure OPD (opd.alpha 1, opd.beta 1): A_t = -r_t
        torch.testing.assert_close(torch.tensor(sample["token_advantages"], dtype=torch.float64), scored - old,
                                   atol=1e-4, rtol=0)
        log_ratios.append(old - scored)
    assert student_would_differ >= 1  # the batch tells the teacher's engine from the student's

    metrics = result["batch_metrics"]
    assert metrics["opd/reverse_kl"] == pytest.approx(float(torch.cat(log_ratios).mean()), abs=1e-4)
    assert metrics["opd/reverse_kl"] < -0.1  # on the teacher's greedy tokens the untrained student is less sure
    assert "mismatch/logprob_abs_diff" not in metrics  # engine logprobs are the teacher's, not a mismatch
    for key in ("loss/policy_loss", "optim/grad_norm", "opd/reverse_kl"):
        assert math.isfinite(result["step_metrics"][key]), key
    assert not result["actor_engine_unchanged"]  # the student's engine received the update
    assert result["teacher_engine_unchanged"]  # the teacher's engine is never synced


def test_teacher_rollouts_config_loads_with_the_ratio_clip_off():
    cfg = load_config(CONFIG, TEACHER_ROLLOUTS)
    assert cfg.opd.rollouts == "teacher" and cfg.algorithm.clip_low == cfg.algorithm.clip_high == 1.0
    assert load_config(CONFIG).opd.rollouts == "student"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["opd.rollouts=teacher"],
         "opd.rollouts teacher trains on off-policy tokens with the PPO ratio clip off .* set "
         "algorithm.clip_low=1.0 algorithm.clip_high=1.0, got 0.2/0.28"),
        ([*TEACHER_ROLLOUTS, "rollout.backend=sglang", "rollout.sglang.urls=http://a:1"],
         "rollout.backend sglang has no teacher rollout servers: use rollout.backend local"),
        (["algorithm.name=grpo", "opd.rollouts=teacher"],
         "opd.rollouts \\(teacher\\) picks who samples opd's training responses; grpo"),
        (["algorithm.clip_low=1.5"], "algorithm.clip_low must be <= 1 \\(1: no lower clip\\), got 1.5"),
    ],
)
def test_teacher_rollouts_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):  # the config's own rules, then the algorithm's
        check_algorithm_config(load_config(CONFIG, overrides))


def test_teacher_rollouts_need_teacher_weights_not_only_a_scoring_url():
    with pytest.raises(ConfigError, match="opd.rollouts teacher needs the teacher's weights"):
        check_algorithm_config(load_config(None, ["model.path=/m", "data.train_path=/d.jsonl", "algorithm.name=opd",
                                                  "rollout.sampling.actor_n=16", "opd.teacher_url=http://t:1",
                                                  *TEACHER_ROLLOUTS]))
