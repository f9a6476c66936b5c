"""Worker: `on_first_rank` shares the first rank's result, or its failure, with every rank (gloo)."""

import sys

import torch.distributed as dist

from megatron_armor.models.hf_config import ModelConfigError
from megatron_armor.teacher.scorer import TeacherError, on_first_rank

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402


def outcome(fn) -> list:
    try:
        return ["ok", on_first_rank(fn)]
    except (TeacherError, ModelConfigError) as error:
        return [type(error).__name__, str(error)]


def fails_with(error: Exception):
    def fn():
        raise error
    return fn


dist.init_process_group("gloo")
write_result(sys.argv[1], {
    "value": outcome(lambda: {"url": "http://teacher:1"}),
    "unexpected": outcome(fails_with(AttributeError("'str' object has no attribute 'get'"))),
    "config": outcome(fails_with(ModelConfigError("vocab 10 != 12"))),
})
dist.destroy_process_group()
