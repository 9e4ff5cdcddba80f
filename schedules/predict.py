"""Predicted step times of a schedule on a mesh, from what ``describe()`` says one rank does,
what the schedule states of its transfers (``schedules.overlap``) and measured figures
(``schedules.figures``, for the table's first device):

    compute  c = FLOPs / rate (the kernel's TFLOP/s at the length of the rank's calls)
    each dim's transfers b = bytes received / bandwidth (of one ring shift alone) add
             max(unhidden * b, b - c * hidden), unhidden being how much of a shift still
             costs beside attention, hidden the share of c the schedule says they overlap
    time = c + the transfers of every mesh dim
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from . import _class, names
from .assign import CUT
from .figures import (  # noqa: F401 (read as predict.TABLE, predict.rate, ...)
    TABLE, Figure, _interpolate, auto_kernel, load_table, measured_device, rate,
    transfer_seconds, work_length)
from .overlap import Overlap, overlap_of


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one rank's step, and how they add up."""

    seconds: float
    compute_s: float
    transfer_s: float
    rate: Figure
    bandwidth: Figure | None


def dims_of(plan) -> list:
    """The Description of every mesh dim of a rank's plan."""
    d = plan.description
    if getattr(d, "dims", None):
        return [dim.description for dim in d.dims]
    return [d]


def overlap(description) -> Overlap:
    """What the schedule that wrote ``description`` states of its transfers."""
    return overlap_of(_class(description.schedule) if description.schedule in names() else None)


def call_length(plan, spec) -> int:
    """Keys per kernel call (packed: the work-weighted mean over the rank's documents)."""
    blocks = math.prod(d.ranks for d in dims_of(plan) if overlap(d).splits_keys)
    if not spec.layout.is_varlen:
        return max(spec.kv_len // blocks, 1)
    return work_length(document_calls(plan, spec, blocks))


def document_calls(plan, spec, blocks: int) -> list[tuple[int, float]]:
    """(keys per call, relative work) of each document in a rank's calls of a packed batch."""
    lengths = [n for _, n in spec.sequences()]
    packing = plan.local.packing
    assignment = getattr(packing, "assignment", None)
    if assignment is None:
        return [(max(n // blocks, 1), n * n / blocks) for n in lengths]
    calls = []
    for n, o, (first, size) in zip(lengths, assignment.owner, assignment.over):
        if o == packing.rank:
            calls.append((n, n * n))
        elif o == CUT and first <= packing.rank < first + size:  # meets its group's blocks
            b = max(blocks * size // packing.parts, 1)
            calls.append((max(n // b, 1), n * n / b))
    return calls


def _in_groups(plan) -> bool:
    """Whether the rank's cut documents are all split over groups smaller than its line
    (their rings move by p2p)."""
    packing = plan.local.packing
    cuts = getattr(packing, "cuts", ())
    return bool(cuts) and all(size < packing.parts for (_, size), _, _ in cuts)


def step_time(plan, spec, *, mode: str, kernel: str, transport: str = "auto",
              path: Path = TABLE) -> StepTime:
    """Predicted seconds of one rank's forward (``mode="fwd"``) or forward+backward step."""
    backward = mode == "fwd+bwd"
    d = plan.description
    flops = d.flops + (d.backward_flops if backward else 0.0)
    r = rate(kernel, spec.head_dim, spec.causal, mode, call_length(plan, spec), path,
             packed=spec.layout.is_varlen)
    compute = flops / r.value
    transfers, link = 0.0, None
    if _in_groups(plan):  # a group's ring moves by p2p (``schedules.whole``)
        transport = "p2p"
    for dim in dims_of(plan):
        seconds, link = transfer_seconds(dim, overlap(dim), compute, backward, transport, path) \
            if dim.bytes_received or backward and dim.backward_bytes_received else (0.0, link)
        transfers += seconds
    return StepTime(compute + transfers, compute, transfers, r, link)
