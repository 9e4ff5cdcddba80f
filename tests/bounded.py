"""A kernel for the tests of kernel limits: the reference kernel with small limits."""

from __future__ import annotations

from sdpa_fusion.kernels import Limits
from sdpa_fusion.kernels.limits import dense_size, packed_rows, span
from sdpa_fusion.kernels.reference import ReferenceKernel


class Bounded(ReferenceKernel):
    """The reference kernel trusted with ``limits`` only; ``calls`` records (what, largest
    tensor span, problem size) of every call it runs, ``past`` those past its limits."""

    name = "bounded"
    native_varlen = True

    def __init__(self, elements: int, rows_per_sequence: int = 0):
        self.limits = Limits(elements, rows_per_sequence)
        self.calls, self.past = [], []

    def _record(self, what, tensors, size):
        widest = max(span(t) for t in tensors)
        self.calls.append((what, widest, size))
        if max(widest, size) > self.limits.elements:
            self.past.append(self.calls[-1])

    def _dense_size(self, q, k):
        return dense_size(q.shape, k.shape, self.limits)

    def _forward(self, q, k, v, **kw):
        self._record("forward", [q, k, v] + [t for t in (kw["out"],) if t is not None],
                     self._dense_size(q, k))
        return super()._forward(q, k, v, **kw)

    def _backward(self, dout, q, k, v, out, lse, **kw):
        self._record("backward", [dout, q, k, v, out], self._dense_size(q, k))
        return super()._backward(dout, q, k, v, out, lse, **kw)

    def _varlen_forward(self, q, k, v, seqlens, **kw):
        rows = packed_rows(seqlens.lengths_q, seqlens.lengths_k, self.limits)
        self._record("varlen_forward", [q, k, v], rows * q.shape[1] * q.shape[2])
        return super()._varlen_forward(q, k, v, seqlens, **kw)

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens, **kw):
        rows = packed_rows(seqlens.lengths_q, seqlens.lengths_k, self.limits)
        self._record("varlen_backward", [dout, q, k, v, out], rows * q.shape[1] * q.shape[2])
        return super()._varlen_backward(dout, q, k, v, out, lse, seqlens, **kw)
