"""NaN and Inf on GPUs: one element of q, k or v set to NaN (or of v to Inf) gives non-finite
outputs and gradients exactly where torch SDPA (its default backend, same dtype) gives them,
on one GPU and under every schedule, with the cuDNN kernel (the merges must not turn them
into numbers). No mask: with a causal mask kernels differ in what masked entries see, and
with an Inf in q or k in how they treat a row whose softmax is Inf / Inf (tests/nonfinite.py
checks those on CPU against torch's math backend).

    mpirun -np 2 python -m pytest tests/gpu_distributed/test_nonfinite_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import schedules
import sdpa_fusion
from tests.nonfinite import plant

from .conftest import requires_gpus

pytestmark = requires_gpus


def _nonfinite(tensors):
    return [~torch.isfinite(t.detach().float()) for t in tensors]


@pytest.mark.parametrize("where,value", [("q", "nan"), ("k", "nan"), ("v", "nan"), ("v", "inf")])
@pytest.mark.parametrize("schedule", [None, "ring", "ulysses", "allgather", "head_parallel"])
def test_nonfinite_like_torch_sdpa(mesh, schedule, where, value):
    p = mesh.size()
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, dout = (torch.randn(1, 4 * p, 256 * p, 128, device="cuda", generator=g,
                                 dtype=torch.bfloat16) for _ in range(4))
    q, k, v = plant(q, k, v, where, value, seed=p)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = F.scaled_dot_product_attention(*leaves)
    want_out.backward(dout)
    want = _nonfinite([want_out, *(t.grad for t in leaves)])

    sched = schedules.get(schedule, mesh) if schedule else None
    shard = sched.shard if sched else (lambda t: t)
    local = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*local, schedule=sched, kernel="cudnn")
    out.backward(shard(dout))
    results = [out, *(t.grad for t in local)]
    got = _nonfinite([sched.unshard(t.detach()) for t in results] if sched else results)
    assert want[0].any(), "torch SDPA itself gives no non-finite output here"
    for name, g_mask, w_mask in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(g_mask, w_mask), (
            f"{name}: non-finite at {g_mask.nonzero().tolist()[:4]} ({int(g_mask.sum())}), torch "
            f"SDPA at {w_mask.nonzero().tolist()[:4]} ({int(w_mask.sum())})"
        )
