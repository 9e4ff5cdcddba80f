"""Packed sequences (THD) under every schedule with each GPU kernel vs the test reference
(tests/reference.py: torch SDPA in fp64) run sequence by sequence on the full tensors, within
the bf16 level of its TOLERANCES.

    mpirun -np 2 python -m pytest -q tests/gpu_distributed/test_thd_gpu.py

Lengths include 0, 1 and lengths that are not multiples of 2 x ranks (padded for the caller);
the GQA cases also give cu_seqlens_padded with padding slots holding random values.
"""

from __future__ import annotations

import functools

import pytest
import torch

import schedules
import sdpa_fusion
from tests import reference

from .conftest import requires_gpus

pytestmark = requires_gpus

SCHEDULES = ["ring", "allgather", "ulysses", "head_parallel"]
KERNELS = ["cudnn", "flash", "nvfuser", "fa4", "auto"]
LENGTHS = [1000, 1, 0, 517, 2051, 64]
SLACK = [3, 0, 5, 0, 1, 0]


@functools.lru_cache(maxsize=4)
def _problem(causal: bool, kv_heads: int, padded: bool, h=8, e=128):
    """(q, k, v, dout, cu_seqlens, cu_seqlens_padded) bf16 on this GPU, and the reference
    (fp64, zero in the padding slots)."""
    slack = SLACK if padded else [0] * len(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32).cuda()
    room = torch.tensor([n + x for n, x in zip(LENGTHS, slack)]).cumsum(0).tolist()
    cu_padded = torch.tensor([0, *room], dtype=torch.int32).cuda() if padded else None
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(room[-1], heads, e, device="cuda", generator=g,
                                 dtype=torch.bfloat16) for heads in (h, kv_heads, kv_heads, h))
    expected = reference.packed(q, k, v, dout, cu, cu_seqlens_padded=cu_padded, causal=causal)
    return (q, k, v, dout, cu, cu_padded), expected


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [8, 4], ids=["mha", "gqa-padded"])
def test_packed_schedule_matches_torch_sdpa(request, mesh, schedule, kernel, causal, kv_heads):
    if kernel == "fa4":
        request.getfixturevalue("fa4_kernel")
    check_packed(schedules.get(schedule, mesh), kernel, causal, kv_heads)


@pytest.mark.parametrize("schedule", ["ulysses", "allgather"])
@pytest.mark.parametrize("transport", ["copy_engine", "p2p"])
@pytest.mark.parametrize("groups", ["auto", 1, 4], ids=["groups-auto", "groups-1", "groups-4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [8, 4], ids=["mha", "gqa-padded"])
def test_packed_pipeline_matches_torch_sdpa(mesh, schedule, transport, groups, causal, kv_heads):
    """Packed head groups in a pipeline over each transport (auto: ulysses takes two groups
    over copy engines): ulysses' exchanges of the next group's heads and the last group's results;
    allgather's gathers into regions used in turn and dK/dV sums landing behind the next
    group's own calls. Four ulysses groups with GQA hold one K/V head each: replicated over
    the ranks, its dK/dV summed as blocks."""
    sched = schedules.get(schedule, mesh, transport=transport, head_groups=groups)
    check_packed(sched, "cudnn", causal, kv_heads)


def check_packed(sched, kernel, causal, kv_heads):
    """``sched`` with ``kernel`` on the packed problem vs torch SDPA per sequence; padding
    tokens get zero output and gradients."""
    (q, k, v, dout, cu, cu_padded), expected = _problem(causal, kv_heads, kv_heads != 8)
    kw = dict(layout="thd", cu_seqlens=cu, cu_seqlens_padded=cu_padded)
    # detached: on one rank a shard may be the (cached, shared) full tensor itself
    q_l, k_l, v_l = (sched.shard(t, **kw).detach().requires_grad_() for t in (q, k, v))
    out_l = sdpa_fusion.attention(q_l, k_l, v_l, causal=causal, kernel=kernel, schedule=sched, **kw)
    out_l.backward(sched.shard(dout, **kw))
    local = (out_l, q_l.grad, k_l.grad, v_l.grad)
    got = [sched.unshard(t, **kw) for t in local]  # every rank's collectives before any assert
    if hasattr(sched, "pack"):
        padding = sched.pack(cu, cu_padded).token_index < 0
        for name, t in zip(("out", "dq", "dk", "dv"), local):
            assert not t[padding].any(), f"{name} is not zero on padding tokens"
    reference.assert_results(got, expected)
