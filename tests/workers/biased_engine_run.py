"""Worker: `armor train` in-process with every local engine's MoE routers choosing their experts on biased logits
(tests/scoring/test_routes.py's ENGINE_BIAS: an engine whose routing differs from the trainer's, as a bf16 or fp8
server's does). argv: out_dir config_yaml overrides..."""

import sys

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
sys.path.insert(0, __file__.rsplit("/workers/", 1)[0] + "/scoring")
from launcher import write_result  # noqa: E402
from test_routes import ENGINE_BIAS, bias_routing  # noqa: E402

from megatron_armor.config import load_config  # noqa: E402
from megatron_armor.rollout.local import LocalEngine  # noqa: E402
from megatron_armor.trainer.run.train import run_training  # noqa: E402

# Every engine is biased as it is made (the run builds its engines through rollout.local's registered builder,
# `LocalEngine.load`, which constructs them).
build = LocalEngine.__init__


def biased_engine(self, *args, **kwargs) -> None:
    build(self, *args, **kwargs)
    bias_routing(self.model, ENGINE_BIAS)


LocalEngine.__init__ = biased_engine
out_dir, config_path, *overrides = sys.argv[1:]
code = run_training(load_config(config_path, overrides))
write_result(out_dir, {"exit_code": code})
sys.exit(code)
