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
    """The kernel ``select`` chose, why it skipped the kernels ranked above it, and (for
    ``auto``) why it chose this one."""

    kernel: Kernel
    skipped: list[str]
    why: str = ""


def select(name: str | Kernel, spec: AttentionSpec, device, *, table=None,
           extent: tuple[int, int] | None = None, calls: int = 1) -> Choice:
    """Resolve ``name`` for ``spec`` on ``device``.

    ``extent``: (rows, keys) of the largest kernel call per head and sequence (a schedule's
    calls may span more keys than the local spec holds; by default the spec's own, the
    longest sequence when packed). A kernel whose limits even a split call would pass there
    cannot run the spec. ``calls``: how many calls a schedule makes on the spec's sequences
    (a ring step each): the packed choice pays each way's host time that often. A named
    kernel that cannot run the spec raises KernelUnavailable with the reason.
    ``auto`` on a GPU tries the kernels in the order of ``ranking.rank`` (fastest measured
    on this device first, by ``table``, default the committed ``ranking.TABLE``) and takes
    the first that can run the spec; for packed sequences it takes the fastest way to run
    them by the cost model (``choice.choose``); on CPU it takes ``reference``.
    """
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
    """``select`` with the committed table, made once per (name, problem, device): a training
    loop asks the same question every step, and the answer cannot change while it runs."""
    return _select(name, spec, device, None, extent, calls)


def _reason(kernel: Kernel, spec: AttentionSpec, device, extent) -> str | None:
    """Why ``kernel`` cannot run ``spec`` on ``device`` with calls up to ``extent`` (naming
    the kernels that can, when it is too long)."""
    reason = kernel.unavailable_reason(spec, device)
    long = None if reason else kernel.too_long(*extent, spec.head_dim)
    if long is None:
        return reason
    able = [repr(n) for n in names()[:-1] if get(n).unavailable_reason(spec, device) is None
            and get(n).too_long(*extent, spec.head_dim) is None]
    return f"{long}; kernel {' or '.join(able) or 'none'} can run it here"


def _select(name, spec: AttentionSpec, device: torch.device, table, extent,
            calls: int = 1) -> Choice:
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
        return Choice(get("reference"), [], f"auto chose reference: the kernel for {device} tensors")
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
