"""Kernel tests run the Triton kernels in the CPU interpreter unless a CUDA GPU is present.

``TRITON_INTERPRET`` must be set before ``kernels.triton_lora`` is imported (``@triton.jit`` reads it when
it decorates a kernel, kernels.md §7); ``kernels`` itself loads that module lazily, so setting it here,
before any test module of this folder is imported, is early enough even though the root conftest has
already imported ``kernels``. On a GPU machine the variable stays unset: the same tests run compiled on CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
