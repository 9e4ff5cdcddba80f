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


class PoisonedDocuments:
    """Packed documents of ``lengths`` with ``padding`` slots after each (``starts``:
    cu_seqlens_padded), q and dout of ``heads`` heads, k and v of ``kv_heads`` (head dim 8):
    ``clean`` as drawn; q, k, v with ``value`` in every padding slot (``real`` marks the
    documents' tokens) and in one K and one V element of document ``poisoned``."""

    def __init__(self, lengths, padding, heads: int, kv_heads: int, value: str,
                 poisoned: int, seed: int):
        self.lengths, self.poisoned = list(lengths), poisoned
        room = [n + p for n, p in zip(lengths, padding)]
        self.starts = [0, *torch.tensor(room).cumsum(0).tolist()]
        self.cu = [0, *torch.tensor(self.lengths).cumsum(0).tolist()]
        total = self.starts[-1]
        g = torch.Generator().manual_seed(seed)
        self.q, self.dout = (torch.randn(total, heads, 8, generator=g) for _ in range(2))
        self.k, self.v = (torch.randn(total, kv_heads, 8, generator=g) for _ in range(2))
        self.clean = [t.clone() for t in (self.q, self.k, self.v)]
        self.real = torch.zeros(total, dtype=torch.bool)
        for a, n in zip(self.starts, self.lengths):
            self.real[a:a + n] = True
        bad = VALUES[value]
        for t in (self.q, self.k, self.v):
            t[~self.real] = bad
        a = self.starts[poisoned]
        self.k[a + 1, 0, 1] = bad
        self.v[a + 2, kv_heads - 1, 0] = bad

    def others(self):
        """(index, start, length) of every document but the poisoned one."""
        return [(i, a, n) for i, (a, n) in enumerate(zip(self.starts, self.lengths))
                if i != self.poisoned]

    @staticmethod
    def document(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """Rows ``start`` .. ``start + n`` of packed ``t`` as one [1, H, n, E] sequence."""
        return t[start:start + n].transpose(0, 1).unsqueeze(0)
