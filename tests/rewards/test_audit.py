"""Audit verifiers: accuracy and hack rate hand-counted on a fixed batch, reward functions loaded from files, and
the start-up errors for missing modules, files and functions."""

import textwrap

import pytest

from megatron_armor.config import RewardConfig
from megatron_armor.data.datasets import PromptRow
from megatron_armor.rewards.audit import AuditCounts, audit_name
from megatron_armor.rewards.registry import RewardError, load_reward_fn
from megatron_armor.rewards.reward_fns import RewardFns
from megatron_armor.rollout.base import Generation, SamplingParams
from megatron_armor.trainer.rollouts.samples import SampleScorer, generate_samples

VERIFIERS = textwrap.dedent('''
    def lenient(response, row):  # the loophole: the answer anywhere in the response
        correct = row["answer"] in response
        return float(correct), correct

    def strict(response, row):
        correct = response.strip() == "Answer: " + row["answer"]
        return float(correct), correct

    def always(response, row):
        return 1.0, True
''')

# prompt 0 (answer 7) and prompt 1 (answer 12), three responses each: (lenient, strict) verdicts in the comments
RESPONSES = [["Answer: 7",  # T, T
              "7 maybe",  # T, F: hacked
              "Answer: 8"],  # F, F
             ["Answer: 12",  # T, T
              "x 12 x",  # T, F: hacked
              "no"]]  # F, F


@pytest.fixture
def verifier_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(VERIFIERS)
    return path


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Answers prompt p's k-th request with RESPONSES[p][k]."""

    def __init__(self):
        self.asked = {}

    def generate(self, prompts, sampling):
        out = []
        for prompt_ids in prompts:
            p = prompt_ids[0]
            k = self.asked.get(p, 0)
            self.asked[p] = k + 1
            ids = [ord(c) for c in RESPONSES[p][k]]
            out.append(Generation(list(prompt_ids), ids, [0.0] * len(ids), "length"))
        return out


def test_audit_accuracy_and_hack_rate_equal_hand_counts(verifier_file):
    rewards = RewardFns.load(RewardConfig(
        train_fn=f"{verifier_file}:lenient", audit_fns=[f"{verifier_file}:strict", f"{verifier_file}:always"]))
    assert rewards.audits.names == ("my_rewards_strict", "my_rewards_always")
    scorer = SampleScorer(CharTokenizer(), rewards.train, audits=rewards.audits)
    prompts = [PromptRow(0, [0], {"answer": "7"}), PromptRow(1, [1], {"answer": "12"})]
    counts = rewards.audits.new_counts()
    samples = generate_samples(ScriptedEngine(), prompts, 3, SamplingParams(), scorer, is_anchor=False, seed=0,
                               audit=counts)
    assert [s.correct for s in samples] == [True, True, False, True, True, False]  # the training verifier's
    assert counts.as_vector() == [6, 2, 6, 2, 0]
    assert counts.metrics() == {
        "audit/my_rewards_strict_accuracy": 2 / 6, "audit/my_rewards_strict_hack_rate": 2 / 6,
        "audit/my_rewards_always_accuracy": 1.0, "audit/my_rewards_always_hack_rate": 0.0,
        "audit/hack_rate": 2 / 6,  # the largest audit's
    }
    assert counts.from_vector([12, 4, 12, 4, 0]).metrics()["audit/hack_rate"] == 4 / 12  # summed over two ranks


def test_no_audits_no_metrics():
    assert AuditCounts(()).metrics() == {}
    assert RewardFns.load(RewardConfig()).audits.names == ()


def test_audit_names():
    assert audit_name("megatron_armor.rewards.math_dapo:verify") == "math_dapo_verify"
    assert audit_name("checks/strict.py:exact") == "strict_exact"


def test_reward_fn_from_a_file_is_loaded_once(verifier_file):
    fn = load_reward_fn(f"{verifier_file}:strict")
    assert fn("Answer: 3", {"answer": "3"}) == (1.0, True)
    assert load_reward_fn(f"{verifier_file}:strict") is fn


@pytest.mark.parametrize(("setting", "path", "message"), [
    ("train_fn", "no/such/file.py:verify", "reward.train_fn: .*no file"),
    ("train_fn", "{file}:missing", "reward.train_fn: .*has no attribute 'missing'"),
    ("val_fn", "megatron_armor.rewards.nothing_here:verify", "reward.val_fn: .*cannot import module"),
    ("audit_fns", ["{file}:strict", "{file}:nope"], r"reward.audit_fns\[1\]: .*has no attribute 'nope'"),
    ("audit_fns", ["{file}:strict", "{file}:strict"], "two audits would log as"),
    ("train_fn", "no_colon", "must look like"),
])
def test_missing_module_file_or_function_is_a_clear_error(verifier_file, setting, path, message):
    value = [p.format(file=verifier_file) for p in path] if isinstance(path, list) else path.format(file=verifier_file)
    with pytest.raises(RewardError, match=message):
        RewardFns.load(RewardConfig(**{setting: value}))


def test_a_file_that_fails_to_execute_names_the_file(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardError, match="executing .*broken.py failed .*boom"):
        load_reward_fn(f"{broken}:verify")
