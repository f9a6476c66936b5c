"""megatron-armor: ARMOR / MIPU / OPD RL post-training on Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron-armor",
    version="0.1.0",
    description="Anchor Rollout and Mixed Optimization RL post-training on Megatron-Core",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_armor", "megatron_armor.*"]),
    install_requires=[
        "torch==2.14.1",
        "megatron-core>=0.19,<0.20",
        "transformers>=5,<6",
        "triton",
        "safetensors",
        "psutil",  # megatron-core's torch_dist checkpoint writer needs it (armor convert)
        "math-verify",
        "ray",
        "sglang-router==0.3.2",  # SGLang's router (runs on CPU): rollout.sglang.router auto uses it; the tests run it
        "pytest",
        "pytest-xdist",  # tests only: scripts/run_tests.sh runs the test files on two workers
        "peft",  # tests only: the PEFT export of LoRA adapters is loaded with it; megatron_armor never imports it
        "pyyaml",
        "pyarrow",
        "tqdm",
        "matplotlib",
        "tensorboard",
        "einops",
    ],
    extras_require={
        # Nothing on the CPU path imports these at module import time.
        # NVIDIA apex is not on the package index under that name; docs/guides/gpu.md has its source install.
        "gpu": ["transformer-engine[pytorch]", "sglang", "flash-attn"],
        "wandb": ["wandb"],
        "bench": ["trl>=1.16"],  # benchmarks/bench_grpo_step.py compares a GRPO step with TRL's GRPOTrainer
    },
    entry_points={"console_scripts": ["armor=megatron_armor.cli:main"]},
)
