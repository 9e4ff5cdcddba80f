"""How ``kernel="auto"`` runs packed sequences on a GPU: every way of every available kernel
in ``PACKED_KERNELS`` (``packed``), estimated by the cost model (``cost``), the fastest taken.
A kernel registered later under a name listed here (``fa4``) enters the choice by itself.
"""

from __future__ import annotations

import itertools
import math

import torch

from ..spec import AttentionSpec
from .base import Kernel, KernelUnavailable, get, names
from .cost import sequence_work, speed
from .packed import Padded, PerSequence, Split, Varlen, has_varlen

PACKED_KERNELS = ("cudnn", "flash", "fa4")


def best_split(spec: AttentionSpec, kernel: Kernel | str, short: Kernel | str,
               calls: int = 1) -> Split | None:
    """The ``Split`` of packed ``spec`` with the fastest ``min_long`` by the cost model
    (``calls`` calls on its sequences, each paying the host time), or None when no split
    leaves both sides non-empty."""
    kernel, short = get(kernel), get(short)
    work = sorted(sequence_work(spec))
    lengths = sorted({n for n, _ in work})
    if len(lengths) < 2:
        return None
    dense, varlen = speed(kernel, "dense"), speed(short, "varlen")
    long_s = [max(dense.host_s, dense.seconds(f, n)) + (calls - 1) * dense.host_s
              for n, f in work]  # as ``choose`` counts a way's host time over ``calls``
    short_s = [varlen.in_varlen(f, n, spec.heads) for n, f in work]
    suffix = list(itertools.accumulate(reversed(long_s), initial=0.0))[::-1]  # of work[i:]
    best, prefix, i = None, 0.0, 0
    for min_long in lengths[1:]:
        while work[i][0] < min_long:
            prefix += short_s[i]
            i += 1
        seconds = varlen.host_s * calls + prefix + suffix[i]
        if best is None or seconds < best[0]:
            best = (seconds, min_long)
    return Split(kernel, short, best[1])


def choose(spec: AttentionSpec, device, extent: tuple[int, int],
           calls: int = 1) -> tuple[Kernel, list[str]]:
    """The fastest way (by the cost model) to run packed ``spec`` on CUDA ``device``, whose
    largest call per head is ``extent`` (rows, keys), in ``calls`` calls (a ring's steps: each
    pays the way's host time, the device time split among them), and notes: why it won, then
    every other way's estimate (what ``explain`` shows)."""
    device = torch.device(device)
    reasons = {name: get(name).unavailable_reason(spec, device)
               or get(name).too_long(*extent, spec.head_dim)
               for name in PACKED_KERNELS if name in names()}
    kernels = [get(name) for name, reason in reasons.items() if reason is None]
    notes = [reason for reason in reasons.values() if reason is not None]
    ways = [w for kernel in kernels for w in
            ([Varlen(kernel)] if has_varlen(kernel) else []) + [PerSequence(kernel), Padded(kernel)]]
    ways += [w for long in kernels for short in kernels if has_varlen(short)
             for w in [best_split(spec, long, short, calls)] if w is not None]
    if not ways:
        raise KernelUnavailable("kernel='auto' found no kernel for these packed sequences: "
                                + "; ".join(notes))
    extra = max(calls - 1, 0)  # every call past the first pays the way's host time again
    timed = sorted((way.estimate(spec) + extra * way.host_seconds(spec), i, way)
                   for i, way in enumerate(ways))
    best_time, _, best = timed[0]
    notes.insert(0, f"auto chose {best.name} for these packed sequences: {_ms(best_time)} "
                    f"forward+backward by the cost model (sdpa_fusion.kernels.cost), the least of")
    notes += [f"{way.name}: estimated {_ms(t)}" for t, _, way in timed[1:]]
    return best, notes


def _ms(seconds: float) -> str:
    return "unfit" if math.isinf(seconds) else f"{seconds * 1e3:.3g} ms"
