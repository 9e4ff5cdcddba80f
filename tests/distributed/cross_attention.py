"""A problem whose keys outnumber its queries (non-causal cross attention), with its
single-process reference, for schedules that shard q and k/v of different lengths alike."""

from __future__ import annotations

import torch

from sdpa_fusion.kernels.reference import ReferenceKernel
from sdpa_fusion.layout import Layout

from .conftest import Problem


def make_cross_problem(s_q: int, s_kv: int, *, h=4, h_kv=2, e=8, layout="bhse") -> Problem:
    """fp32 q [1, h, s_q, e] over k, v [1, h_kv, s_kv, e], and the reference results."""
    layout = Layout.of(layout)
    g = torch.Generator().manual_seed(1)
    q, dout = (layout.to(torch.randn(1, h, s_q, e, generator=g)) for _ in range(2))
    k, v = (layout.to(torch.randn(1, h_kv, s_kv, e, generator=g)) for _ in range(2))
    ref, scale = ReferenceKernel(), e ** -0.5
    out, lse = ref.forward(q, k, v, causal=False, scale=scale)
    grads = ref.backward(dout, q, k, v, out, lse, causal=False, scale=scale)
    return Problem(q, k, v, dout, out, *grads, layout, False, None)
