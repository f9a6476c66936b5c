"""Without a GPU the kernels run in Triton's CPU interpreter; it must be on before the kernels are defined."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
