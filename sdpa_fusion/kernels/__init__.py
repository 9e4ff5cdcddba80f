"""Local attention kernels behind one contract (see ``base``), chosen by name or ``auto``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..spec import AttentionSpec
from . import aten, fa4, nvfuser, ranking, reference  # noqa: F401  (register the kernels)
from .base import Dropout, Kernel, KernelUnavailable, Seqlens, get, names, register
from .choice import choose
from .packed import Padded, PerSequence, Split, Varlen


class Choice(NamedTuple):
    """The kernel ``select`` chose, why it skipped the kernels ranked above it, and (for
    ``auto``) why it chose this one."""

    kernel: Kernel
    skipped: list[str]
    why: str = ""


def select(name: str | Kernel, spec: AttentionSpec, device, *, table=None) -> Choice:
    """Resolve ``name`` for ``spec`` on ``device``.

    A named kernel that cannot run the spec raises KernelUnavailable with the reason.
    ``auto`` on a GPU tries the kernels in the order of ``ranking.rank`` (fastest measured
    on this device first, by ``table``, default the committed ``ranking.TABLE``) and takes
    the first that can run the spec; for packed sequences it takes the fastest way to run
    them by the cost model (``choice.choose``); on CPU it takes ``reference``.
    """
    device = torch.device(device)
    if table is None and isinstance(name, str):
        return _select_cached(name, spec, device)
    return _select(name, spec, device, table)


@functools.lru_cache(maxsize=1024)
def _select_cached(name: str, spec: AttentionSpec, device: torch.device) -> Choice:
    """``select`` with the committed table, made once per (name, problem, device): a training
    loop asks the same question every step, and the answer cannot change while it runs."""
    return _select(name, spec, device, None)


def _select(name, spec: AttentionSpec, device: torch.device, table) -> Choice:
    if name != "auto":
        kernel = get(name)
        kernel.check(spec, device)
        return Choice(kernel, [])
    if spec.layout.is_varlen and device.type == "cuda":
        way, notes = choose(spec, device)
        return Choice(way, notes[1:], notes[0])
    if device.type != "cuda":
        reason = get("reference").unavailable_reason(spec, device)
        if reason is not None:
            raise KernelUnavailable(f"kernel='auto' found no kernel for this problem: {reason}")
        return Choice(get("reference"), [], f"auto chose reference: the kernel for {device} tensors")
    order = ranking.rank(ranking.load_table() if table is None else table,
                         ranking.gpu(device), spec.head_dim, spec.causal)
    reasons = {k: get(k).unavailable_reason(spec, device) for k in order.order}
    chosen, skipped, why = ranking.choose(order, reasons)
    if chosen is None:
        raise KernelUnavailable("kernel='auto' found no kernel for this problem: "
                                + "; ".join(skipped))
    return Choice(get(chosen), skipped, why)


__all__ = ["Choice", "Dropout", "Kernel", "KernelUnavailable", "Padded", "PerSequence", "Seqlens",
           "Split", "Varlen", "get", "names", "register", "select"]
