"""Fixtures for GPU tests run on every rank under mpirun (one GPU per rank, NCCL):

    mpirun -np 4 python -m pytest tests/gpu_distributed

Without CUDA every test here is skipped. Every test starts from a barrier of all ranks
(``barrier`` of tests/distributed/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

import sdpa_fusion
from tests.distributed.conftest import barrier  # noqa: F401  (autouse: every test starts together)

requires_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
    reason="needs Ampere or newer NVIDIA GPUs",
)


@pytest.fixture(scope="session")
def mesh():
    m = sdpa_fusion.init_mesh((-1,), ("seq",))
    yield m
    sdpa_fusion.close_mesh()


def pytest_runtest_logreport(report):
    """Print a failure the moment it happens: a rank whose test failed before a collective
    leaves the other ranks waiting, and the report at the end of the run may never come."""
    if report.failed:
        import sys

        print(f"\nFAILED NOW {report.nodeid} ({report.when}):\n{report.longreprtext[-4000:]}",
              file=sys.stderr, flush=True)
