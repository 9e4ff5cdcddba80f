"""Helpers shared by the single-process tests.

- ``rng``: a torch.Generator seeded the same for every test (and every rank).
- ``fa4_kernel``: the fa4 kernel; its tests skip without a GPU or FlashAttention-4, and fail
  instead when SDPA_FUSION_REQUIRE_FA4=1 (a GPU machine where FA4 was staged).
- tests marked ``gpu`` are skipped when torch sees no CUDA device.

The reference every suite compares against, and the tolerances per dtype: tests/reference.py.
"""

from __future__ import annotations

import os

import pytest
import torch

SEED = 1234


@pytest.fixture(scope="session")
def fa4_kernel():
    """The fa4 kernel, when it can run on this GPU; else a skip, or a failure when
    SDPA_FUSION_REQUIRE_FA4=1 says that FlashAttention-4 was installed here."""
    from sdpa_fusion import AttentionSpec
    from sdpa_fusion.kernels import get

    reason = "needs a CUDA GPU; torch sees none"
    if torch.cuda.is_available():
        probe = AttentionSpec(batch=1, heads=8, kv_heads=8, q_len=256, kv_len=256, head_dim=128,
                              dtype=torch.bfloat16)
        reason = get("fa4").unavailable_reason(probe, torch.device("cuda"))
    if reason is None:
        return get("fa4")
    if os.environ.get("SDPA_FUSION_REQUIRE_FA4") == "1":
        pytest.fail(f"SDPA_FUSION_REQUIRE_FA4=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def rng() -> torch.Generator:
    """A CPU generator seeded with SEED (the same in every test and on every rank)."""
    return torch.Generator().manual_seed(SEED)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


try:  # keep property tests deterministic and free of timing flakes on busy CI machines
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
    settings.register_profile("dev", deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
except ImportError:
    pass
