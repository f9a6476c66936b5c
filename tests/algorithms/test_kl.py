import math

import pytest
import torch

from megatron_armor.algorithms import kl_penalty


def test_estimators_match_definitions_and_reject_unknown():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    expected = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(expected, rel=1e-6)
    assert torch.isfinite(kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")).all()
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(logp, ref, "k4")
