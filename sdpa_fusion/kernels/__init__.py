"""Local attention kernels behind one contract (see ``base``), chosen by name or ``auto``."""

from __future__ import annotations

import torch

from ..spec import AttentionSpec
from . import aten, nvfuser, reference  # noqa: F401  (register the kernels)
from .base import Dropout, Kernel, KernelUnavailable, Seqlens, get, names, register
from .choice import choose
from .packed import Padded, PerSequence, Split, Varlen

# Fastest first on Hopper/Ampere: cuDNN, then ATen flash, then nvFuser (also ATen flash).
AUTO_ORDER = ("cudnn", "flash", "nvfuser")


def select(name: str | Kernel, spec: AttentionSpec, device) -> tuple[Kernel, list[str]]:
    """Resolve ``name`` for ``spec`` on ``device``: (kernel, notes on skipped kernels).

    A named kernel that cannot run the spec raises KernelUnavailable with the reason.
    ``auto`` takes the first kernel of AUTO_ORDER that can, falling back to ``reference``
    on CPU, and records why it skipped the others; for packed sequences on a GPU it takes
    the fastest way to run them by the cost model (``choice.choose``).
    """
    device = torch.device(device)
    if name != "auto":
        kernel = get(name)
        kernel.check(spec, device)
        return kernel, []
    if spec.layout.is_varlen and device.type == "cuda":
        return choose(spec, device)
    notes = []
    candidates = AUTO_ORDER if device.type == "cuda" else ("reference",)
    for candidate in candidates:
        reason = get(candidate).unavailable_reason(spec, device)
        if reason is None:
            return get(candidate), notes
        notes.append(reason)
    raise KernelUnavailable("kernel='auto' found no kernel for this problem: " + "; ".join(notes))


__all__ = ["Dropout", "Kernel", "KernelUnavailable", "Padded", "PerSequence", "Seqlens", "Split", "Varlen",
           "get", "names", "register", "select"]
