"""`armor plan` on every recipe in examples/ for the hardware its header names: each fits (exit code 0)."""

from pathlib import Path

import pytest
import yaml

from megatron_armor.cli import main

EXAMPLES = Path(__file__).parents[2] / "examples"
# recipe -> (GPUs, GB per GPU) as its header (run_torchrun.sh) names them; the tiny CPU recipes run as `--nproc 2`
# on a CPU box, planned here as two 16 GB devices.
HARDWARE = {
    "qwen2.5-math-7b/armor.yaml": (128, 80),  # 16 nodes x 8 H100/H200 (80+ GB)
    "qwen3-8b-base/armor.yaml": (128, 80),  # 16 nodes x 8 H100/H200 (80+ GB)
    "qwen3-8b-base-long/armor.yaml": (128, 80),  # 16 nodes x 8 H100/H200 (80+ GB)
    "qwen3-8b-base-lora/armor.yaml": (128, 80),  # 16 nodes x 8 H100/H200 (80+ GB)
    "qwen3-30b-a3b/armor.yaml": (128, 80),  # 16 nodes x 8 H100/H200 (80+ GB)
    "glm-4.5-air/armor.yaml": (128, 141),  # 16 nodes x 8 H200 (141 GB)
    "deepseek-v3/armor.yaml": (384, 141),  # 48 nodes x 8 H200 (141 GB)
    "qwen3-1.7b/mipu.yaml": (8, 80),  # 1 node x 8 H100 (80 GB)
    "tiny/agentic.yaml": (1, 16),  # one process
    "tiny/armor.yaml": (2, 16),
    "tiny/mipu.yaml": (2, 16),
    "tiny/opd.yaml": (2, 16),
}


def test_every_recipe_has_its_hardware():
    """Every training config under examples/ (a mapping; a dataset list for `armor eval` is a YAML list)."""
    recipes = [p for p in EXAMPLES.glob("*/*.yaml") if isinstance(yaml.safe_load(p.read_text()), dict)]
    assert sorted(str(p.relative_to(EXAMPLES)) for p in recipes) == sorted(HARDWARE)


@pytest.mark.parametrize("recipe", sorted(HARDWARE))
def test_recipe_fits_its_hardware(recipe, capsys):
    gpus, memory = HARDWARE[recipe]
    code = main(["plan", "--config", str(EXAMPLES / recipe), "--gpus", str(gpus), "--gpu-memory-gb", str(memory)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "\nfits\n" in out and "per GPU (estimate):" in out


def test_a_layout_that_does_not_fit_names_the_knobs(capsys):
    recipe = EXAMPLES / "qwen3-8b-base/armor.yaml"
    code = main(["plan", "--config", str(recipe), "--gpus", "128", "--gpu-memory-gb", "80", "--recompute.granularity", "none"])
    out = capsys.readouterr().out
    assert code == 1
    assert "does NOT fit" in out and "turn on recompute.granularity full" in out and "(fits)" in out


def test_plan_help_and_bad_layout(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", "--help"])
    assert done.value.code == 0 and "--gpu-memory-gb" in capsys.readouterr().out
    recipe = EXAMPLES / "qwen3-1.7b/mipu.yaml"
    assert main(["plan", "--config", str(recipe), "--gpus", "8", "--gpu-memory-gb", "80", "--tp", "3"]) == 2
    assert main(["plan", "--config", str(recipe), "--gpus", "8", "--gpu-memory-gb", "80",
                 "--parallel.context_parallel_size", "3", "--parallel.data_parallel_size", "1"]) == 2
    assert "tp x pp x cp = 3 GPUs do not divide the 8 GPUs" in capsys.readouterr().err


def test_plan_of_a_context_parallel_layout(capsys):
    """The long-response recipe (CP 2): the layout names cp, the activations are a CP rank's share, and the plan
    says how long a response fits without and with context parallelism."""
    recipe = EXAMPLES / "qwen3-8b-base-long/armor.yaml"
    assert main(["plan", "--config", str(recipe), "--gpus", "128", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "layout: tp 4 x pp 1 x cp 2 x dp 8 = 64 trainer GPUs of 128" in out
    assert "32768 tokens/micro-batch (16384 per CP rank)" in out and "Adam distributed over dp x cp" in out
    assert ("longest responses that fit (rollout.sampling.max_new_tokens): 25600 tokens without context parallelism "
            "(dp 16), 54272 with parallel.context_parallel_size 2 (dp 8)") in out
