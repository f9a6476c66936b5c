import pytest
import torch

from megatron_armor.scoring.logprobs import ScoringConfig, resolve_logprob_head


@pytest.mark.parametrize("cuda, expected", [(False, "torch"), (True, "fused")])
def test_auto_head_is_fused_on_gpu_and_torch_on_cpu(monkeypatch, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_logprob_head("auto") == expected
    assert resolve_logprob_head("torch") == "torch"  # an explicit choice stands on either machine
    assert resolve_logprob_head("fused") == "fused"


def test_scoring_settings_refuse_unresolved_or_unknown_heads():
    for head in ("auto", "softmax"):
        with pytest.raises(ValueError, match="unknown logprob head"):
            ScoringConfig(head=head)
