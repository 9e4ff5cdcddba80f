"""NaN and Inf in attention inputs, and where they must come out.

The reference is tests/reference.py (torch SDPA's math backend in fp64). Without a mask the
results must have NaN, +Inf and -Inf exactly where it has them. With a causal mask, torch's
own math multiplies masked probabilities (0) by the values and adds the mask to the scores,
so a non-finite key, value or query also reaches entries that do not depend on it (0 * Inf,
NaN + -Inf); kernels that skip masked blocks do so less. There the results must be non-finite
wherever the row-wise reference (``by_rows``: each query row over the keys it sees, what
depends on a non-finite input) is, and only where the full-matrix math is: no value
swallowed, none made up. Finite values agree within the tolerance of fp32 (TOLERANCES).
"""

from __future__ import annotations

import torch

from tests import reference

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def plant(q, k, v, where: str, value: str, seed: int):
    """Copies of q, k, v with one element of ``where`` ("q", "k" or "v") set to ``value``."""
    q, k, v = (t.detach().clone() for t in (q, k, v))
    t = {"q": q, "k": k, "v": v}[where]
    g = torch.Generator().manual_seed(seed)
    index = tuple(int(torch.randint(n, (1,), generator=g)) for n in t.shape)
    t[index] = VALUES[value]
    return q, k, v


def mismatch(got, q, k, v, dout, *, causal: bool, scale=None) -> str | None:
    """Where ``got`` (out, dq, dk, dv) departs from the reference (see the module docstring)."""
    lower = reference.attention(q, k, v, dout, causal=causal, scale=scale, by_rows=causal)
    upper = reference.attention(q, k, v, dout, causal=causal, scale=scale) if causal else lower
    atol, rtol = reference.TOLERANCES[torch.float32]
    for name, g, lo, up in zip(("out", "dq", "dk", "dv"), got, lower.results, upper.results):
        g = g.double()
        if causal:
            bad = ~torch.isfinite(g)
            for what, wrong in (("finite where the row-wise reference is not",
                                 ~torch.isfinite(lo) & ~bad),
                                ("non-finite where torch's math is finite",
                                 bad & torch.isfinite(up))):
                if wrong.any():
                    return f"{name}: {what} at {wrong.nonzero().tolist()[:6]}"
        else:
            for kind, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
                if not torch.equal(test(g), test(lo)):
                    return (f"{name}: {kind} at {test(g).nonzero().tolist()[:6]}, the reference "
                            f"at {test(lo).nonzero().tolist()[:6]}")
        both = torch.isfinite(g) & torch.isfinite(lo)
        if not torch.allclose(g[both], lo[both], rtol=rtol, atol=atol):
            return f"{name}: finite values differ by {(g[both] - lo[both]).abs().max():.2e}"
    return None
