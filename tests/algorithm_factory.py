"""Algorithm objects for tests, built as a run builds them: from a config of the synthetic task."""

from megatron_armor.algorithms import Algorithm, algorithm_class, build_algorithm
from megatron_armor.config import load_config


def make_algorithm(name: str, *overrides: str) -> Algorithm:
    """The registered algorithm `name` with `overrides` (`section.field=value`); algorithms without anchors get
    rollout.sampling.actor_n = n_samples (16), and the synthetic task's warm start is OPD's teacher."""
    group = [] if algorithm_class(name).uses_anchors else ["rollout.sampling.actor_n=16"]
    base = ["task.synthetic=arithmetic", "task.warm_start_steps=10", f"algorithm.name={name}", *group]
    return build_algorithm(load_config(None, [*base, *overrides]))
