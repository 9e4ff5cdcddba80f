"""Predicted step times of a schedule on a mesh, from measured figures.

The model takes what ``describe()`` says one rank does (FLOPs, bytes received), what the
schedule states of its transfers (``schedules.overlap``) and the measured figures of
``cost_table.json`` (``schedules.figures``):

    rate       the kernel's TFLOP/s on one GPU for the head dim, mask and mode at the length
               of the rank's kernel calls (S over the ranks of the dims whose schedule splits
               the keys; packed, the work-weighted length of its documents' calls, at the
               share of the dense rate that packed batches reached)
    bandwidth  GB/s of one ring shift alone, per transport and block size (collectives: p2p)
    unhidden   how much of a shift still costs while attention runs beside it

    compute  c = FLOPs / rate
    each dim's transfers b = bytes received / bandwidth add max(unhidden * b, b - c * hidden),
             hidden being the share of the compute the schedule says its transfers can run
             beside (none unless it says: then they add b)
    time = c + the transfers of every mesh dim

Predictions are for the table's first device, with the kernel ``auto`` ranks first there
unless one is named.
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


# ---- the model ---------------------------------------------------------------------------
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
    """Keys per kernel call: S over the ranks of the dims whose schedule splits the keys;
    packed, the work-weighted mean over the documents of the rank's calls."""
    blocks = math.prod(d.ranks for d in dims_of(plan) if overlap(d).splits_keys)
    if not spec.layout.is_varlen:
        return max(spec.kv_len // blocks, 1)
    return work_length(document_calls(plan, spec, blocks))


def document_calls(plan, spec, blocks: int) -> list[tuple[int, float]]:
    """(keys per call, relative work) of each document in a rank's calls of a packed batch:
    its whole ones at their length, each cut one at a ``blocks``-th of it and of its work."""
    lengths = [n for _, n in spec.sequences()]
    assignment = getattr(plan.local.packing, "assignment", None)
    owner = assignment.owner if assignment is not None else [CUT] * len(lengths)
    mine = plan.local.packing.rank if assignment is not None else None
    return [(n, n * n) if o == mine else (max(n // blocks, 1), n * n / blocks)
            for n, o in zip(lengths, owner) if o in (mine, CUT)]


def step_time(plan, spec, *, mode: str, kernel: str, transport: str = "auto",
              path: Path = TABLE) -> StepTime:
    """Predicted seconds of one rank's forward (``mode="fwd"``) or forward+backward step;
    ``transport`` is the schedule's option (``auto``: copy engines, GPUs of one host)."""
    backward = mode == "fwd+bwd"
    d = plan.description
    flops = d.flops + (d.backward_flops if backward else 0.0)
    r = rate(kernel, spec.head_dim, spec.causal, mode, call_length(plan, spec), path,
             packed=spec.layout.is_varlen)
    compute = flops / r.value
    transfers, link = 0.0, None
    for dim in dims_of(plan):
        seconds, link = transfer_seconds(dim, overlap(dim), compute, backward, transport, path) \
            if dim.bytes_received or backward and dim.backward_bytes_received else (0.0, link)
        transfers += seconds
    return StepTime(compute + transfers, compute, transfers, r, link)
