"""GPU-extra detection: NVIDIA apex is recognised by its compiled `amp_C` module, not by the name `apex`."""

import sys
import types

from megatron_armor.utils.extras import detect_gpu_extras


def test_cpu_box_reports_no_extras_and_apex_needs_amp_c(monkeypatch):
    extras = detect_gpu_extras()
    assert extras.cuda is False and extras.transformer_engine is False and extras.sglang is False
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))  # the unrelated PyPI `apex`
    assert detect_gpu_extras().apex is False
    fake = types.ModuleType("amp_C")
    fake.__spec__ = types.SimpleNamespace(name="amp_C")
    monkeypatch.setitem(sys.modules, "amp_C", fake)
    assert detect_gpu_extras().apex is True
    assert "apex=yes" in detect_gpu_extras().describe()
