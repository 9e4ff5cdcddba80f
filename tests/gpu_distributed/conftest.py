"""Fixtures for GPU tests run on every rank under mpirun (one GPU per rank, NCCL):

    mpirun -np 4 python -m pytest tests/gpu_distributed

Without CUDA every test here is skipped.
"""

from __future__ import annotations

import pytest
import torch

import sdpa_fusion

requires_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
    reason="needs Ampere or newer NVIDIA GPUs",
)


@pytest.fixture(scope="session")
def mesh():
    m = sdpa_fusion.init_mesh((-1,), ("seq",))
    yield m
    sdpa_fusion.close_mesh()
