"""Head groups and in-place merges on GPUs, and the step memory of the ring under its bound.

    mpirun -np 2 python -m pytest tests/gpu_distributed/test_memory_gpu.py

The fa4 cases skip without FlashAttention-4 (or fail with SDPA_FUSION_REQUIRE_FA4=1).
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from sdpa_fusion import merge

from .conftest import requires_gpus
from .test_schedules_gpu import _check_schedule

pytestmark = requires_gpus

GIB = float(1 << 30)


@pytest.mark.parametrize("schedule", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("kernel", ["cudnn", "fa4"])
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_groups_match_torch_sdpa(request, mesh, schedule, kernel, layout, causal):
    """Two head groups (strided head slices into the kernels, the transports and the
    collectives), GQA 8:4, against torch SDPA in fp32; the merge ran fused (no torch fallback)."""
    if kernel == "fa4":
        request.getfixturevalue("fa4_kernel")
    _check_schedule(mesh, schedule, kernel, layout, causal, options=dict(head_groups=2), h_kv=4)
    assert not merge._UNFUSED, "LseMerge in place failed here"


@pytest.mark.parametrize("kernel", ["cudnn", "fa4"])
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_head_groups_of_one_head_match_torch_sdpa(request, mesh, kernel, layout):
    """Head groups of one query head each: the in-place fold computes the weights of a
    single head's rows (``MergeWeights(1)``, a broadcast head dim)."""
    if kernel == "fa4":
        request.getfixturevalue("fa4_kernel")
    _check_schedule(mesh, "ring", kernel, layout, True, options=dict(head_groups=4), h=4,
                    h_kv=4)
    assert not merge._UNFUSED, "WeightedSum in place failed here"


def test_ring_bf16_sums_match_torch_sdpa(mesh):
    _check_schedule(mesh, "ring", "cudnn", "bshe", True,
                    options=dict(grad_dtype="input", head_groups=2), h_kv=4)


def step_bytes(step, kept=lambda: 0) -> int:
    """Bytes one call of ``step`` allocates at its peak beyond what was allocated before
    (``kept``: memory held outside the caching allocator, added)."""
    step()  # warm: kernels chosen and compiled, symmetric memory grown
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base + kept()


def test_ring_step_memory_under_its_bound(mesh):
    """Causal forward+backward at 32K tokens, 8 heads of 128, bf16, in 4 head groups: the
    ring's step (kept symmetric memory included) is what describe() says, and at most 0.6x
    the step of one GPU on the whole sequence (two ranks or more: one is no ring)."""
    if mesh.size() == 1:
        pytest.skip("a ring of one rank holds the whole problem: needs two GPUs or more")
    s, h, e = 32 * 1024, 8, 128
    sched = schedules.get("ring", mesh, head_groups=4)
    g = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn(1, h, s, e, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(4)]
    q, k, v = (sched.shard(t).detach().requires_grad_() for t in full[:3])
    dout = sched.shard(full[3])

    def ring_step():
        out = sdpa_fusion.attention(q, k, v, causal=True, schedule=sched)
        torch.autograd.grad(out, (q, k, v), dout)

    ring = step_bytes(ring_step, lambda: sched.kept_bytes)
    described = sched.describe(sdpa_fusion.AttentionSpec(1, h, h, s, s, e, causal=True,
                                                         dtype=torch.bfloat16)).memory
    q1, k1, v1 = (t.detach().requires_grad_() for t in full[:3])

    def one_gpu_step():
        out = sdpa_fusion.attention(q1, k1, v1, causal=True)
        torch.autograd.grad(out, (q1, k1, v1), full[3])

    one = step_bytes(one_gpu_step)
    print(f"rank {mesh.rank}: ring step {ring / GIB:.3f} GiB (described {described.step / GIB:.3f},"
          f" kept {sched.kept_bytes / GIB:.3f}), one GPU {one / GIB:.3f} GiB: {ring / one:.2f}x")
    assert ring <= 1.1 * described.step
    assert ring <= 0.6 * one
