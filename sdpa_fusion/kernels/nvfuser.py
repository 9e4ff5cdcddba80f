"""The nvFuser kernel: attention through the fusions of ``sdpa_fusion.definitions``.

Every call takes the shared fusion for its problem (``Definition.cached``), whose batch and
sequence lengths are symbolic. ``split_heads`` gives a kernel whose fusions carry nvFuser's
DID head split, called with this rank's head shards (as nvFuser's multidevice SDPA tests).
With dropout, the forward runs under the CUDA generator at the ``Dropout``'s stream and
leaves the philox seed and offset it returns in ``dropout.state`` for the backward.
"""

from __future__ import annotations

import functools

import torch

from ..layout import exact_strides
from ..spec import AttentionSpec
from .base import (Dropout, Kernel, KernelUnavailable, expand_kv_heads, layout_of, on_cuda,
                   reduce_kv_heads, register)
from .limits import Limits, dense_pieces, fits

INSTALL_HINT = "pip install nvfuser-cu128-torch210 (or nvfuser-cu130-torch210)"


@functools.cache
def import_error() -> str | None:
    """Why ``nvfuser_direct`` cannot be imported here, or None when it can."""
    try:
        import nvfuser_direct  # noqa: F401
    except (ImportError, OSError) as e:
        return str(e)
    return None


class NvFuserKernel(Kernel):
    """nvFuser's ``sdpfa_fwd`` / ``sdpfa_bwd`` (ATen FlashAttention-2 inside a fusion)."""

    name = "nvfuser"
    supports_dropout = True
    limits = Limits(why="tested up to 2^31 (ATen flash inside the fusion)")

    def __init__(self, mesh=None, parts: int = 1):
        self.mesh, self.parts = mesh, parts

    def _unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        error = import_error()
        if error is not None:
            return f"kernel 'nvfuser' needs nvfuser_direct ({INSTALL_HINT}): {error}"
        if spec.causal and spec.q_len != spec.kv_len:
            return _bottom_right(spec)
        if spec.head_dim > 256:
            return f"kernel 'nvfuser' supports head_dim <= 256, got {spec.head_dim}"
        return None

    def split_heads(self, mesh, dim: str) -> "NvFuserKernel":
        """This kernel for the local head shards of a head-parallel schedule over ``mesh``'s
        dim ``dim``: its fusions carry the DID split."""
        return NvFuserKernel(mesh.nvfuser_mesh(dim), mesh.size(dim))

    def _split_kv(self, q, k, v):
        """(k, v, groups) as the fusion takes them: the K/V heads expanded here (gradients
        summed back by ``reduce_kv_heads``) where nvFuser 0.2.36 gets its own GQA expand
        wrong: under a DID head split, for a single K/V head (MQA, laid out inconsistently),
        and for a batch or sequence extent of 1 (a reshape concretized as a squeeze it then
        rejects)."""
        groups = q.shape[1] // k.shape[1]
        one_extent = 1 in (q.shape[0], q.shape[2], k.shape[2])
        if groups == 1 or (self.mesh is None and k.shape[1] > 1 and not one_extent):
            return k, v, 1
        return expand_kv_heads(k, groups), expand_kv_heads(v, groups), groups

    def _forward(self, q, k, v, *, causal, scale, window, dropout: Dropout | None, out, lse):
        k, v, _ = self._split_kv(q, k, v)
        spec = self._spec(q, k, causal, scale, dropout)
        outs = self._execute("SdpaForward", spec, self._dense(spec, q, k, v), dropout)
        if spec.dropout_p > 0:
            dropout.state = (outs[2], outs[3])
        return outs[0], outs[1]

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, window,
                  dropout: Dropout | None, dq, dk, dv):
        k, v, groups = self._split_kv(q, k, v)
        spec = self._spec(q, k, causal, scale, dropout)
        inputs = [*self._dense(spec, dout, q, k, v, out), exact_strides(lse.contiguous(), range(3)),
                  *_rng_state(spec, dropout, q.device)]
        dq, dk, dv = self._execute("SdpaBackward", spec, inputs)
        return dq, reduce_kv_heads(dk, groups), reduce_kv_heads(dv, groups)

    def forward_backward(self, q, k, v, dout, *, causal, scale, dropout: Dropout | None = None,
                         window=None):
        """(out, lse, dq, dk, dv) from one fusion of forward and backward (a call past the
        limits runs as ``forward`` and ``backward``, which split it)."""
        if dense_pieces(q.shape, k.shape, self.limits) or not all(
                fits(t, self.limits) for t in (q, k, v, dout)):
            mask = dict(causal=causal, scale=scale, dropout=dropout, window=window)
            out, lse = self.forward(q, k, v, **mask)
            return (out, lse, *self.backward(dout, q, k, v, out, lse, **mask))
        k, v, groups = self._split_kv(q, k, v)
        spec = self._spec(q, k, causal, scale, dropout)
        outs = self._execute("SdpaForwardBackward", spec, self._dense(spec, q, k, v, dout),
                             dropout)
        if spec.dropout_p > 0:
            dropout.state = (outs[5], outs[6])
        out, lse, dq, dk, dv = outs[:5]
        return out, lse, dq, reduce_kv_heads(dk, groups), reduce_kv_heads(dv, groups)

    def _spec(self, q, k, causal, scale, dropout) -> AttentionSpec:
        """The problem the fusion is defined for: global head counts under a head split; a
        call that the fusion would mask otherwise than asked (causal, q_len != kv_len) is
        refused, whichever caller made it."""
        b, h, s_q, e = q.shape
        spec = AttentionSpec(
            batch=b, heads=h * self.parts, kv_heads=k.shape[1] * self.parts, q_len=s_q,
            kv_len=k.shape[2], head_dim=e, dtype=q.dtype, causal=bool(causal), scale=scale,
            dropout_p=dropout.p if dropout is not None else 0.0, layout=layout_of(q),
        )
        if spec.causal and spec.q_len != spec.kv_len:
            raise KernelUnavailable(_bottom_right(spec))
        return spec

    def _execute(self, name: str, spec: AttentionSpec, inputs, dropout=None):
        """The shared fusion ``name`` of ``spec`` run on ``inputs`` (a forward: under the CUDA
        generator at the dropout's stream)."""
        from .. import definitions

        with on_cuda(dropout, inputs[0].device):
            fusion = getattr(definitions, name).cached(spec, mesh=self.mesh, parts=self.parts)
            return fusion.execute(inputs, scale=spec.softmax_scale, dropout_p=spec.dropout_p)

    @staticmethod
    def _dense(spec: AttentionSpec, *tensors):
        """``tensors`` dense in the query's layout (themselves when they already are), with
        exactly the strides the fusion's inputs declare."""
        return [exact_strides(spec.layout.to(t), spec.layout.memory_order) for t in tensors]

    def __repr__(self) -> str:
        split = f" split over {self.parts} on {self.mesh}" if self.mesh is not None else ""
        return f"<kernel {self.name}{split}>"


def _rng_state(spec: AttentionSpec, dropout: Dropout | None, device) -> list:
    """The philox seed and offset a dropout backward replays (zeros, unused, without dropout)."""
    if spec.dropout_p == 0:
        return list(_zero_rng_state(torch.device(device)))
    if len(dropout.state) != 2:
        raise ValueError(f"dropout (p={dropout.p}) has no philox seed/offset; pass the Dropout "
                         f"object that the forward filled in, so the backward replays its mask")
    return list(dropout.state)


@functools.cache
def _zero_rng_state(device: torch.device):
    return (torch.zeros(2, dtype=torch.uint64, device=device),
            torch.zeros((), dtype=torch.uint64, device=device))


register(NvFuserKernel())


def _bottom_right(spec: AttentionSpec) -> str:
    return (f"kernel 'nvfuser' runs ATen flash, which aligns the causal mask bottom-right, "
            f"so causal with q_len={spec.q_len} != kv_len={spec.kv_len} is not the "
            f"top-left mask asked for")
