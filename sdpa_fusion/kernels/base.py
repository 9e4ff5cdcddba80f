"""The one contract every local attention kernel serves, and the registry of kernels.

    forward(q, k, v, *, causal, scale, dropout=None) -> (out, lse)
    backward(dout, q, k, v, out, lse, *, causal, scale, dropout=None) -> (dq, dk, dv)

Tensors are logical [B, H, S, E] in BHSE or BSHE memory order; outputs keep the query's
layout. ``lse`` is fp32 [B, H, S_q]. ``causal`` is aligned top-left (key j is masked for
query i when j > i). K/V may have fewer heads than Q (GQA). ``backward`` takes the *global*
out and lse of the row, so it can be applied block by block (ring attention).
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from ..layout import Layout
from ..spec import AttentionSpec


class KernelUnavailable(ValueError):
    """A kernel cannot run a given spec on a given device (the message says why)."""


@dataclasses.dataclass
class Dropout:
    """Dropout probability plus the RNG state the forward used, for the backward to replay."""

    p: float
    seed: torch.Tensor | None = None
    offset: torch.Tensor | None = None


class Kernel(abc.ABC):
    """A local attention kernel; see the module docstring for the contract."""

    name: str = ""
    gpu_only: bool = True
    supports_dropout: bool = False

    def unavailable_reason(self, spec: AttentionSpec, device: torch.device) -> str | None:
        """Why this kernel cannot run ``spec`` on ``device``, or None when it can."""
        device = torch.device(device)
        if self.gpu_only:
            if device.type != "cuda":
                return f"kernel {self.name!r} runs on CUDA GPUs only; the tensors are on {device}"
            major, minor = torch.cuda.get_device_capability(device)
            if major < 8:
                return (
                    f"kernel {self.name!r} needs an Ampere or newer GPU (sm80+); "
                    f"{torch.cuda.get_device_name(device)} is sm{major}{minor}"
                )
            if spec.dtype not in (torch.float16, torch.bfloat16):
                return f"kernel {self.name!r} takes float16 or bfloat16, not {spec.dtype}"
        if spec.dropout_p > 0 and not self.supports_dropout:
            return f"kernel {self.name!r} has no dropout; use kernel='nvfuser' for dropout_p > 0"
        return self._unavailable_reason(spec, device)

    def _unavailable_reason(self, spec: AttentionSpec, device: torch.device) -> str | None:
        return None

    def split_heads(self, mesh, dim: str) -> "Kernel":
        """This kernel for the local head shards of a head-parallel schedule over ``mesh``'s
        dim ``dim``: itself by default; the nvFuser kernel returns one whose fusions carry
        the DID split."""
        return self

    def check(self, spec: AttentionSpec, device: torch.device) -> None:
        reason = self.unavailable_reason(spec, device)
        if reason is not None:
            raise KernelUnavailable(reason)

    @abc.abstractmethod
    def forward(self, q, k, v, *, causal: bool, scale: float, dropout: Dropout | None = None):
        ...

    @abc.abstractmethod
    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float,
                 dropout: Dropout | None = None):
        ...

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"


def expand_kv_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeat each K/V head ``groups`` times along dim 1 (GQA -> MHA), keeping the layout."""
    if groups == 1:
        return t
    b, h_kv, s, e = t.shape
    expanded = t.unsqueeze(2).expand(b, h_kv, groups, s, e).reshape(b, h_kv * groups, s, e)
    return like_layout(expanded, t)


def reduce_kv_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradients of repeated K/V heads back onto their K/V head (inverse of expand)."""
    if groups == 1:
        return grad
    b, h, s, e = grad.shape
    reduced = grad.unflatten(1, (h // groups, groups)).sum(2, dtype=torch.float32).to(grad.dtype)
    return like_layout(reduced, grad)


def layout_of(t: torch.Tensor) -> Layout:
    """BSHE when heads are inner to tokens in memory, else BHSE."""
    return Layout.BSHE if t.shape[1] > 1 and t.shape[2] > 1 and t.stride(1) < t.stride(2) else Layout.BHSE


def like_layout(t: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """``t`` with the memory order (BHSE or BSHE) of ``model``."""
    return layout_of(model).to(t)


_REGISTRY: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    """Make ``kernel`` available by its name to ``get`` and ``attention(kernel=...)``."""
    _REGISTRY[kernel.name] = kernel
    return kernel


def names() -> list[str]:
    return sorted(_REGISTRY) + ["auto"]


def get(name: str | Kernel) -> Kernel:
    """The kernel registered as ``name`` (``auto`` is resolved by ``select``)."""
    if isinstance(name, Kernel):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"kernel={name!r} is not known; choose one of {names()}")
    return _REGISTRY[name]
