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

build = LocalEngine.load.__func__


def biased_engine(cls, *args, **kwargs) -> LocalEngine:
    engine = build(cls, *args, **kwargs)
    bias_routing(engine.model, ENGINE_BIAS)
    return engine


LocalEngine.load = classmethod(biased_engine)
out_dir, config_path, *overrides = sys.argv[1:]
code = run_training(load_config(config_path, overrides))
write_result(out_dir, {"exit_code": code})
sys.exit(code)
