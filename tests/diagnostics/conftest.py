"""The diagnostics tests decompose tiny matrices: one intra-op thread avoids stalls on a busy shared CPU."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
