"""NaN and Inf in attention inputs, and where they must come out.

The oracle is torch SDPA's math backend in fp64. Without a mask the results must have NaN,
+Inf and -Inf exactly where it has them. With a causal mask, torch's own math multiplies
masked probabilities (0) by the values and adds the mask to the scores, so a non-finite key,
value or query also reaches entries that do not depend on it (0 * Inf, NaN + -Inf); kernels
that skip masked blocks do so less. There the results must be non-finite wherever the row-wise
oracle (each query row over the keys it sees: what depends on a non-finite input) is, and
only where the full-matrix math backend is: no value swallowed, none made up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def plant(q, k, v, where: str, value: str, seed: int):
    """Copies of q, k, v with one element of ``where`` ("q", "k" or "v") set to ``value``."""
    q, k, v = (t.detach().clone() for t in (q, k, v))
    t = {"q": q, "k": k, "v": v}[where]
    g = torch.Generator().manual_seed(seed)
    index = tuple(int(torch.randint(n, (1,), generator=g)) for n in t.shape)
    t[index] = VALUES[value]
    return q, k, v


def oracle(q, k, v, dout, *, causal: bool, scale=None, rows: bool = True):
    """out, dq, dk, dv of torch's math SDPA in fp64; with ``causal`` and ``rows``, each query
    row attends alone to the keys it sees, else the whole masked matrix at once."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel(SDPBackend.MATH):
        if causal and rows:
            out = torch.cat([F.scaled_dot_product_attention(
                qd[:, :, i:i + 1], kd[:, :, :i + 1], vd[:, :, :i + 1], scale=scale, enable_gqa=gqa)
                for i in range(q.shape[2])], dim=2)
        else:
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale,
                                                 enable_gqa=gqa)
    out.backward(dout.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


def mismatch(got, q, k, v, dout, *, causal: bool, scale=None) -> str | None:
    """Where ``got`` (out, dq, dk, dv) departs from the oracle (see the module docstring)."""
    lower = oracle(q, k, v, dout, causal=causal, scale=scale)
    upper = oracle(q, k, v, dout, causal=causal, scale=scale, rows=False) if causal else lower
    for name, g, lo, up in zip(("out", "dq", "dk", "dv"), got, lower, upper):
        g = g.double()
        if causal:
            bad = ~torch.isfinite(g)
            for what, wrong in (("finite where the row-wise oracle is not", ~torch.isfinite(lo) & ~bad),
                                ("non-finite where torch's math is finite", bad & torch.isfinite(up))):
                if wrong.any():
                    return f"{name}: {what} at {wrong.nonzero().tolist()[:6]}"
        else:
            for kind, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
                if not torch.equal(test(g), test(lo)):
                    return (f"{name}: {kind} at {test(g).nonzero().tolist()[:6]}, the oracle at "
                            f"{test(lo).nonzero().tolist()[:6]}")
        both = torch.isfinite(g) & torch.isfinite(lo)
        if not torch.allclose(g[both], lo[both], rtol=1e-4, atol=1e-4):
            return f"{name}: finite values differ by {(g[both] - lo[both]).abs().max():.2e}"
    return None
