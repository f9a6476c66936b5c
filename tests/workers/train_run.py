"""Worker: run `armor train` in-process on every rank. argv: out_dir config_yaml [--resume] overrides..."""

import sys

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

from megatron_armor.config import load_config  # noqa: E402
from megatron_armor.trainer.run.train import run_training  # noqa: E402

out_dir, config_path, *rest = sys.argv[1:]
resume = "--resume" in rest
overrides = [arg for arg in rest if arg != "--resume"]
code = run_training(load_config(config_path, overrides), resume=resume)
write_result(out_dir, {"exit_code": code})
sys.exit(code)
