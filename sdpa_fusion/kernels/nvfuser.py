"""The nvFuser kernel: SdpaForward / SdpaBackward fusions (sdpfa_fwd / sdpfa_bwd).

Placeholder until the fusion definitions land."""

from __future__ import annotations

from .base import Kernel, register


class NvFuserKernel(Kernel):
    name = "nvfuser"
    supports_dropout = True

    def forward(self, q, k, v, *, causal, scale, dropout=None):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, dropout=None):
        raise NotImplementedError


register(NvFuserKernel())
