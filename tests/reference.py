"""The one reference of the test suites, and the one table of tolerances.

    from tests import reference
    want = reference.attention(q, k, v, dout, causal=True, scale=0.3, window=(3, 0))
    want.out, want.lse, want.dq, want.dk, want.dv           # fp64, logical [B, H, S, E]
    want = reference.packed(q, k, v, dout, cu_seqlens, causal=True)  # [T, H, E], per sequence
    reference.assert_close(got, want.out, torch.bfloat16)    # the tolerance of that dtype
    reference.assert_results((out, dq, dk, dv), want)        # all four, by the inputs' dtype

The reference is torch's ``scaled_dot_product_attention`` on its math backend, on fp64 copies
of the inputs, with autograd for the gradients; it shares no code with the package (the
product's fp32 ``reference`` kernel is a kernel: tests/test_reference.py checks it against
this). Masks are ours, built here from their definition:

- causal is top-left aligned: query i sees key j <= i, also when queries and keys differ in
  number (torch's ``is_causal`` agrees only for square problems, so a mask is passed);
- a window (left, right) lets query i see keys i - left <= j <= i + right (None: unbounded);
- GQA: query head h reads K/V head h // (H / H_kv) (``enable_gqa``);
- a row that sees no key gives out 0, lse -inf and no gradient (torch gives NaN there);
- packed sequences run one by one (``packed``); everything outside a sequence is 0 (lse -inf).

``by_rows=True`` runs each query row alone over the keys it sees: what depends on a
non-finite input and nothing else (tests/nonfinite.py); without it the masked matrix is
computed whole, as torch's math does (a masked +Inf score plus the mask's -inf is NaN).
``dropout=(keep, p)`` applies a given keep-mask [B, H, S_q, S_kv]: softmax * keep / (1 - p).
"""

from __future__ import annotations

import math
import typing

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (atol, rtol) for results computed in a dtype, compared against the fp64 reference on inputs
# of unit scale: fp32 accumulation over a few hundred keys stays near 1e-6; bf16 and fp16
# results are off by their rounding (2^-8 and 2^-11 relative) plus the rounding of the inputs
# the gradients are built from. A test that needs less slack says so where it asks.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# A softmax scale far above 1/sqrt(E) (1.0 over E = 32: scores of std 5.7) makes sharp
# softmaxes, whose fp32 gradients carry twice the rounding: the level of ``sharp=True``.
SHARP = {torch.float32: (2e-5, 2e-5)}


def tolerance(dtype: torch.dtype, *, sharp: bool = False) -> dict:
    """``dict(atol=, rtol=)`` for results computed in ``dtype`` (for torch.testing);
    ``sharp``: of scores far above unit scale (``SHARP``, where it has the dtype)."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for {dtype}; TOLERANCES has {list(TOLERANCES)}")
    atol, rtol = SHARP[dtype] if sharp and dtype in SHARP else TOLERANCES[dtype]
    return dict(atol=atol, rtol=rtol)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 msg: str = "", *, sharp: bool = False) -> None:
    """``actual`` equals ``expected`` in fp64 within the tolerance of ``dtype`` (the dtype
    ``actual`` was computed in; ``actual.dtype`` when None); shapes must agree."""
    assert actual.shape == expected.shape, \
        f"{msg + ': ' if msg else ''}shape {list(actual.shape)} != {list(expected.shape)}"
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(),
                               **tolerance(dtype or actual.dtype, sharp=sharp),
                               msg=lambda m: f"{msg}: {m}" if msg else m)


class Expected(typing.NamedTuple):
    """What the reference gives (fp64): out, lse [B, H, S] (packed: [H, T]), dq, dk, dv
    (None without a dout)."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None

    @property
    def results(self) -> tuple:
        """(out, dq, dk, dv)."""
        return self.out, self.dq, self.dk, self.dv


NAMES = ("out", "dq", "dk", "dv")


def assert_results(got, expected: Expected, dtype: torch.dtype | None = None,
                   msg: str = "") -> None:
    """``got`` = (out, dq, dk, dv) equal ``expected``'s within the tolerance of ``dtype``
    (each result's own dtype when None)."""
    for name, g, w in zip(NAMES, got, expected.results):
        assert_close(g, w, dtype, msg=f"{msg} {name}".strip())


def window_sides(window) -> tuple[int | None, int | None]:
    """(left, right) of ``window``: None, a (left, right) pair or an object with ``left`` and
    ``right`` (sdpa_fusion's Window)."""
    if window is None:
        return None, None
    if hasattr(window, "left"):
        return window.left, window.right
    left, right = window
    return left, right


def visible(s_q: int, s_kv: int, causal: bool, window=None, device=None) -> torch.Tensor | None:
    """[s_q, s_kv] bool, True where query i may see key j (top-left: j <= i when causal;
    i - left <= j <= i + right under a window); None when every query sees every key."""
    left, right = window_sides(window)
    if not causal and left is None and right is None:
        return None
    i = torch.arange(s_q, device=device).unsqueeze(1)
    j = torch.arange(s_kv, device=device).unsqueeze(0)
    seen = torch.ones(s_q, s_kv, dtype=torch.bool, device=device)
    if causal:
        seen = seen & (j <= i)
    if left is not None:
        seen = seen & (j >= i - left)
    if right is not None:
        seen = seen & (j <= i + right)
    return seen


def _sdpa(q, k, v, mask, scale, dropout):
    """torch SDPA's math (or softmax * keep / (1 - p) under ``dropout``) of fp64 tensors."""
    gqa = q.shape[1] != k.shape[1]
    if dropout is None:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=gqa)
    keep, p = dropout
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) * keep.to(scores.device) / (1 - p)) @ v


def attention(q, k, v, dout=None, *, causal: bool = False, scale: float | None = None,
              window=None, mask: torch.Tensor | None = None, by_rows: bool = False,
              dropout=None) -> Expected:
    """The reference on logical [B, H, S_q, E] q and [B, H_kv, S_kv, E] k, v (any memory
    order, any dtype); gradients of ``dout`` when given. ``mask`` [S_q, S_kv] bool, True
    where a query sees a key, stands for ``causal`` and ``window`` (keys of several blocks
    softmaxed together, say)."""
    qd, kd, vd = (t.detach().double().requires_grad_(dout is not None) for t in (q, k, v))
    s_q, s_kv = q.shape[2], k.shape[2]
    if mask is None:
        mask = visible(s_q, s_kv, causal, window, q.device)
    # rows that see no key: they see every key here, then their out (and dout) is set to 0
    empty = None if mask is None else ~mask.any(-1, keepdim=True)
    if by_rows:
        out = torch.cat([_row(qd, kd, vd, i, None if mask is None else mask[i], scale, dropout)
                         for i in range(s_q)], dim=2)
    else:
        out = _sdpa(qd, kd, vd, None if mask is None else mask | empty, scale, dropout)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    lse = _lse(qd.detach(), kd.detach(), mask, scale)
    if dout is None:
        return Expected(out.detach(), lse, None, None, None)
    out.backward(dout.detach().double())
    return Expected(out.detach(), lse, qd.grad, kd.grad, vd.grad)


def _row(q, k, v, i: int, seen, scale, dropout):
    """Query row ``i`` over the keys it sees, alone: [B, H, 1, E] (0 when it sees none)."""
    keys = torch.arange(k.shape[2], device=k.device) if seen is None else seen.nonzero()[:, 0]
    if len(keys) == 0:
        return torch.zeros_like(q[:, :, i:i + 1])
    if dropout is not None:
        dropout = (dropout[0][:, :, i:i + 1].index_select(-1, keys.to(dropout[0].device)),
                   dropout[1])
    return _sdpa(q[:, :, i:i + 1], k.index_select(2, keys), v.index_select(2, keys), None,
                 scale, dropout)


def _lse(q, k, mask, scale) -> torch.Tensor:
    """logsumexp of the scores over the keys each row sees (-inf where it sees none)."""
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2)
    scores = scores * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def spans(cu_seqlens, starts=None) -> list[tuple[int, int]]:
    """(start, length) of every sequence: lengths from ``cu_seqlens``, starts from ``starts``
    (a cu_seqlens_padded) or ``cu_seqlens`` itself."""
    cu = [int(x) for x in cu_seqlens]
    at = cu if starts is None else [int(x) for x in starts]
    return [(a, b - c) for a, c, b in zip(at, cu, cu[1:])]


def packed(q, k, v, dout=None, cu_seqlens=None, *, cu_seqlens_k=None, cu_seqlens_padded=None,
           causal: bool = False, scale: float | None = None, window=None,
           by_rows: bool = False) -> Expected:
    """The reference on packed [T, H, E] q and [T_k, H_kv, E] k, v, sequence by sequence:
    sequence i has the queries of ``cu_seqlens`` and the keys of ``cu_seqlens_k`` (the same
    when None), starting where ``cu_seqlens_padded`` says (user padding) when given. out, dq
    [T, H, E], dk, dv [T_k, H_kv, E] and lse [H, T]; 0 (lse -inf) outside every sequence."""
    queries = spans(cu_seqlens, cu_seqlens_padded)
    keys = queries if cu_seqlens_k is None else spans(cu_seqlens_k)
    wide = dict(dtype=torch.float64, device=q.device)
    out = torch.zeros(q.shape, **wide)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, **wide)
    grads = None if dout is None else [torch.zeros(t.shape, **wide) for t in (q, k, v)]
    for (qa, n), (ka, m) in zip(queries, keys):
        if n == 0 or m == 0:  # no queries, or queries that see no key: 0 and -inf
            continue
        views = [t[a:a + length].transpose(0, 1).unsqueeze(0)
                 for t, (a, length) in zip((q, k, v), ((qa, n), (ka, m), (ka, m)))]
        d = None if dout is None else dout[qa:qa + n].transpose(0, 1).unsqueeze(0)
        part = attention(*views, d, causal=causal, scale=scale, window=window, by_rows=by_rows)
        out[qa:qa + n] = part.out[0].transpose(0, 1)
        lse[:, qa:qa + n] = part.lse[0]
        if grads is not None:
            for full, g, (a, length) in zip(grads, part[2:], ((qa, n), (ka, m), (ka, m))):
                full[a:a + length] = g[0].transpose(0, 1)
    return Expected(out, lse, *(grads or (None, None, None)))
