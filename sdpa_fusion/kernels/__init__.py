"""Local attention kernels behind one contract (see ``base``), chosen by name or ``auto``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..spec import AttentionSpec
from . import aten, fa4, nvfuser, ranking, reference  # noqa: F401  (register the kernels)
from .base import Dropout, Kernel, KernelUnavailable, Seqlens, get, names, register
from .limits import Limits
from .choice import choose
from .packed import Padded, PerSequence, Split, Varlen


class Choice(NamedTuple):
    """The kernel ``select`` chose, why it skipped those ranked above, and why it chose it."""

    kernel: Kernel
    skipped: list[str]
    why: str = ""


def select(name: str | Kernel, spec: AttentionSpec, device, *, table=None,
           extent: tuple[int, int] | None = None, calls: int = 1) -> Choice:
    """Resolve ``name`` for ``spec`` on ``device`` (KernelUnavailable, with the reason, when
    a named kernel cannot run it). ``extent``: (rows, keys) of the largest kernel call per
    head and sequence, which even split must fit the kernel's limits (default
    ``spec_extent``). ``calls``: a schedule's calls on the sequences (a ring step each), each
    paying a packed way's host time. ``auto`` takes ``reference`` on CPU; on a GPU, the
    fastest packed way by the cost model (``choice.choose``), else the first kernel of
    ``ranking.rank`` (fastest measured here, by ``table``) that can run the spec."""
    device = torch.device(device)
    extent = extent or spec_extent(spec)
    if table is None and isinstance(name, str):  # no rank's packing kept (it holds a schedule)
        return _select_cached(name, spec.replace(packing=None) if spec.packing is not None
                              else spec, device, extent, calls)
    return _select(name, spec, device, table, extent, calls)


def spec_extent(spec: AttentionSpec) -> tuple[int, int]:
    """(rows, keys) of the largest call per head of ``spec`` run on its own: the longest
    packed sequence, or the dense lengths."""
    if spec.layout.is_varlen:
        longest = max((n for _, n in spec.sequences()), default=0)
        return longest, longest
    return spec.q_len, spec.kv_len


@functools.lru_cache(maxsize=1024)
def _select_cached(name: str, spec: AttentionSpec, device: torch.device, extent,
                   calls: int) -> Choice:
    """``select`` with the committed table, made once: a training loop asks every step."""
    return _select(name, spec, device, None, extent, calls)


def _reason(kernel: Kernel, spec: AttentionSpec, device, extent) -> str | None:
    """Why ``kernel`` cannot run ``spec`` on ``device`` with calls up to ``extent`` (naming
    the kernels that can when it is too long), or None."""
    reason = kernel.unavailable_reason(spec, device)
    long = None if reason else kernel.too_long(*extent, spec.head_dim)
    if long is None:
        return reason
    able = [repr(n) for n in names()[:-1] if get(n).unavailable_reason(spec, device) is None
            and get(n).too_long(*extent, spec.head_dim) is None]
    return f"{long}; kernel {' or '.join(able) or 'none'} can run it here"


def _select(name, spec: AttentionSpec, device: torch.device, table, extent, calls) -> Choice:
    if name != "auto":
        kernel = get(name)
        reason = _reason(kernel, spec, device, extent)
        if reason is not None:
            raise KernelUnavailable(reason)
        return Choice(kernel, [])
    if spec.layout.is_varlen and device.type == "cuda":
        way, notes = choose(spec, device, extent, calls)
        return Choice(way, notes[1:], notes[0])
    if device.type != "cuda":
        reason = _reason(get("reference"), spec, device, extent)
        if reason is not None:
            raise KernelUnavailable(f"kernel='auto' found no kernel for this problem: {reason}")
        why = f"auto chose reference: the kernel for {device} tensors"
        return Choice(get("reference"), [], why)
    order = ranking.rank(ranking.load_table() if table is None else table,
                         ranking.gpu(device), spec.head_dim, spec.causal)
    reasons = {k: _reason(get(k), spec, device, extent) for k in order.order}
    chosen, skipped, why = ranking.choose(order, reasons)
    if chosen is None:
        raise KernelUnavailable("kernel='auto' found no kernel for this problem: "
                                + "; ".join(skipped))
    return Choice(get(chosen), skipped, why)


__all__ = ["Choice", "Dropout", "Kernel", "KernelUnavailable", "Limits", "Padded", "PerSequence",
           "Seqlens", "Split", "Varlen", "get", "names", "register", "select", "spec_extent"]
