"""How close an attention's out and gradients come to fp32, against torch's own error.

The yardstick: torch SDPA in the problem's dtype (bf16) on one device, against the same
attention computed in fp32 (torch's memory-efficient kernel on GPUs, which takes fp32 and
needs no S x S buffer; the math kernel on CPUs). An implementation's error on a tensor is
||x - ref|| / ||ref|| against that fp32 result; its ratio is that error over torch's, worst
of out, dq, dk, dv (goal: at most 2).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from benchmarks.common import relative_error

NAMES = ("out", "dq", "dk", "dv")


def sdpa_step(q, k, v, dout, causal: bool, backend) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of torch SDPA on ``backend`` (an SDPBackend)."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


@dataclasses.dataclass
class Reference:
    """fp32 (out, dq, dk, dv) of a problem and torch's own error on each in its dtype."""

    results: tuple
    torch_errors: dict

    @classmethod
    def of(cls, q, k, v, dout, causal: bool) -> "Reference":
        from torch.nn.attention import SDPBackend

        cuda = q.is_cuda
        wide = SDPBackend.EFFICIENT_ATTENTION if cuda else SDPBackend.MATH
        narrow = SDPBackend.CUDNN_ATTENTION if cuda else SDPBackend.MATH
        results = sdpa_step(*(t.float() for t in (q, k, v, dout)), causal, wide)
        torch_own = sdpa_step(q, k, v, dout, causal, narrow)
        errors = {n: relative_error(x, r) for n, x, r in zip(NAMES, torch_own, results)}
        return cls(results, errors)

    def errors(self, got) -> dict:
        """Relative errors of ``got`` (out, dq, dk, dv) against the fp32 results, and
        ``ratio``: the worst of them over torch's own."""
        errors = {n: relative_error(x, r) for n, x, r in zip(NAMES, got, self.results)}
        errors["ratio"] = max(errors[n] / max(self.torch_errors[n], 1e-30) for n in NAMES)
        return errors
