"""FlashAttention-4 (``flash-attn-4``, CuTe DSL kernels) behind the kernel contract.

Optional: ``pip install 'sdpa-fusion[fa4]'`` installs the tested version; it is imported on
first use (``unavailable_reason`` says how to install it). How the contract maps onto FA4:

- Layouts, no copies: FA4 takes [B, S, H, D] tensors with any 16-byte aligned strides, so
  q, k, v, out and dout go in as ``.transpose(1, 2)`` views, BHSE or BSHE alike, and FA4
  writes out and the gradients into buffers in their own tensor's layout.
- GQA: native (dK/dV summed in fp32 inside).
- Masks: FA4 aligns causal and window masks bottom-right: query i sees key j when
  ``i + d - left <= j <= i + d + right`` with ``d = s_k - s_q``. Our top-left band is that
  window shifted by d (``fa4_window``). A packed call needs one shift: under a mask, one
  whose sequences differ in keys minus queries runs sequence by sequence.
- Rows that see no key: out 0 and lse -inf, as the contract asks; the backward reads lse
  -inf as a row without probability mass.
- float16/bfloat16, no dropout; sm90 (head dim up to 256) and sm100/sm110 (up to 128, or
  256); no backward below sm90.
- The first call of each configuration (dtype, head dim, GQA ratio, mask kind, dense or
  packed) compiles it, about 5-8 s; ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps
  compiled kernels on disk. The backward is not bitwise deterministic (dQ sums atomically).
"""

from __future__ import annotations

import torch

from ..spec import AttentionSpec
from . import fa4_rows
from .base import Kernel, Seqlens, Window, band, register
from .fa4_entry import INSTALL_HINT, backward, bshd, forward, import_error
from .limits import Limits, dense_pieces, fits
from .pieces import empty_like


def limits_reason(spec: AttentionSpec, capability: tuple[int, int]) -> str | None:
    """Why FA4 cannot run ``spec`` on a GPU of ``capability``, from FA4's own limits."""
    major, minor = capability
    if major not in (9, 10, 11):
        return (f"kernel 'fa4' runs forward and backward on sm90 (Hopper) and sm100/sm110 "
                f"(Blackwell); this GPU is sm{major}{minor}")
    if spec.head_dim > 256:
        return f"kernel 'fa4' supports head_dim <= 256, got {spec.head_dim}"
    if major >= 10 and 128 < spec.head_dim < 256:
        return (f"kernel 'fa4' on sm{major}{minor} supports head_dim <= 128 or 256, "
                f"got {spec.head_dim}")
    if major >= 10 and spec.head_dim == 256 and not spec.layout.is_varlen:
        window = fa4_window(spec.causal, spec.window, spec.q_len, spec.kv_len)
        if any(side is not None and side < 0 for side in window):
            return (f"kernel 'fa4' on sm{major}{minor} at head_dim 256 reads a negative window "
                    f"as unbounded; this mask with q_len={spec.q_len} != kv_len={spec.kv_len} "
                    f"needs one")
    return None


def fa4_window(causal: bool, window: Window | None, s_q: int, s_k: int):
    """FA4's (window_size_left, window_size_right), aligned bottom-right, for our top-left
    band of ``causal`` and ``window`` (None: unbounded). The two are never both negative,
    which FA4 would read as no window at all."""
    left, right = band(causal, window)
    shift = s_k - s_q
    return (None if left is None else left + shift, None if right is None else right - shift)


def varlen_shift(seqlens: Seqlens, causal: bool, window: Window | None) -> int | None:
    """The keys minus queries by which one FA4 varlen call aligns every packed sequence's
    mask (0 without a mask; sequences without queries or keys take any), or None when masked
    sequences differ in it or FA4's window would need a negative side."""
    if band(causal, window) == (None, None):
        return 0
    shifts = seqlens.shifts
    shift = next(iter(shifts)) if len(shifts) == 1 else (None if shifts else 0)
    if shift is None or any(side is not None and side < 0
                            for side in fa4_window(causal, window, 0, shift)):
        return None
    return shift


def _contiguous_or_new(buffer: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A given packed output buffer FA4 writes as it is (contiguous), else a new one (the
    caller copies the result into the given buffer)."""
    if buffer is not None and buffer.is_contiguous():
        return buffer
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


class FlashAttention4Kernel(Kernel):
    """FlashAttention-4 (``flash_attn.cute``): dense and packed, GQA, windows, head dim 256."""

    name = "fa4"
    supports_window = True
    native_varlen = True
    # its workspaces round every sequence's rows up to a tile (128, two in some configurations)
    limits = Limits(rows_per_sequence=256, why="FA4 computes some offsets in 32 bits "
                    "(flash-attention issue 2611: its varlen backward wraps them past 2^31)")

    def _unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        reason = limits_reason(spec, torch.cuda.get_device_capability(device))
        if reason is None and import_error() is not None:
            reason = f"kernel 'fa4' needs FlashAttention-4 ({INSTALL_HINT}): {import_error()}"
        return reason

    def _forward(self, q, k, v, *, causal, scale, window, dropout, out, lse):
        out = empty_like(q) if out is None else out
        if lse is None or not lse.is_contiguous():  # FA4 writes a dense lse
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        forward(bshd(q), bshd(k), bshd(v), scale=scale, out=bshd(out), lse=lse,
                window=fa4_window(causal, window, q.shape[2], k.shape[2]))
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, window, dropout, dq, dk, dv):
        dq, dk, dv = (empty_like(t) if g is None else g for g, t in zip((dq, dk, dv), (q, k, v)))
        backward(*map(bshd, (q, k, v, out, dout)), lse, scale=scale,
                 window=fa4_window(causal, window, q.shape[2], k.shape[2]),
                 dq=bshd(dq), dk=bshd(dk), dv=bshd(dv))
        return dq, dk, dv

    def query_rows(self, q, dout, out, lse, *, scale, spans):
        """On Hopper, ``fa4_rows.QueryRows`` for calls it takes (``fa4_rows.rows_fit``) whose
        rows stay inside the limits (it launches FA4's kernels on them as they are)."""
        b, h, s, e = q.shape
        rounded = (b, h, s + self.limits.rows_per_sequence, e)
        if (not fa4_rows.usable(q.device) or import_error() is not None
                or not all(fits(t, self.limits) for t in (q, dout, out))
                or dense_pieces(rounded, rounded, self.limits) != []
                or not fa4_rows.rows_fit(spans, q.shape[2], q.shape[-1])):
            return None
        return fa4_rows.QueryRows(q, dout, out, lse, scale=scale)

    def _varlen_forward(self, q, k, v, seqlens: Seqlens, *, causal, scale, window, out=None,
                        lse=None):
        shift = varlen_shift(seqlens, causal, window)
        if shift is None:
            return super()._varlen_forward(q, k, v, seqlens, causal=causal, scale=scale,
                                           window=window, out=out, lse=lse)
        out = _contiguous_or_new(out, q)  # lse: FA4's own (a given one is copied into: small)
        lse = forward(q, k, v, scale=scale, window=fa4_window(causal, window, 0, shift), out=out,
                      packed=self._packed(seqlens, q.device))
        # FA4 masks every score of a sequence without keys, but multiplies the probabilities
        # (all 0) with values loaded from outside the sequence, which need not be finite
        for qa, qb in seqlens.rows_without_keys:
            out[qa:qb] = 0
            lse[:, qa:qb] = float("-inf")
        return out, lse

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens: Seqlens, *, causal, scale,
                         window, dq=None, dk=None, dv=None):
        shift = varlen_shift(seqlens, causal, window)
        if shift is None:
            return super()._varlen_backward(dout, q, k, v, out, lse, seqlens, causal=causal,
                                            scale=scale, window=window, dq=dq, dk=dk, dv=dv)
        dq, dk, dv = (_contiguous_or_new(g, t) for g, t in zip((dq, dk, dv), (q, k, v)))
        return backward(q, k, v, out, dout, lse, scale=scale,
                        window=fa4_window(causal, window, 0, shift), dq=dq, dk=dk, dv=dv,
                        packed=self._packed(seqlens, q.device))

    @staticmethod
    def _packed(seqlens: Seqlens, device) -> dict:
        cu_q, cu_k = seqlens.tensors(device)
        return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=seqlens.max_q,
                    max_seqlen_k=seqlens.max_k)


register(FlashAttention4Kernel())
