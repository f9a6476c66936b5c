"""A single-process Megatron world for the planning tests (tp = pp = dp = 1)."""

import pytest

from megatron_armor.distributed.init import destroy_distributed, initialize_distributed


@pytest.fixture(scope="module")
def megatron_world():
    initialize_distributed(1, 1, 1)
    yield
    destroy_distributed()
