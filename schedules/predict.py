"""Predicted step times of a schedule on a mesh, from measured figures.

The model takes what ``describe()`` says one rank does (FLOPs, bytes received), what the
schedule states of its transfers (its ``Overlap``, ``schedules.overlap``) and the measured
figures of ``cost_table.json`` beside this module (written by ``python -m
benchmarks.cost_table`` from the benchmark results it names):

    rate       the kernel's TFLOP/s on one GPU for the same head dim, mask and mode at the
               length of the rank's kernel calls (interpolated in log(length), held at the
               ends): S over the ranks of the dims whose schedule splits the keys, else S
    bandwidth  GB/s of one ring shift alone, per transport and block size; transfers that
               do not go by a schedule's own transport (collectives) use the p2p figure
    unhidden   how much of a shift still costs while attention runs beside it

    compute  c = FLOPs / rate
    each dim's transfers b = bytes received / bandwidth add max(unhidden * b, b - c * hidden),
             hidden being the share of the compute the schedule says its transfers can run
             beside (none unless it says: then they add b)
    time = c + the transfers of every mesh dim

Predictions are for the table's first device (the GPU the committed results measured); the
kernel is the one ``auto`` ranks first there unless one is named.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from sdpa_fusion.kernels import ranking

from . import _class, names
from .overlap import Overlap, overlap_of

TABLE = Path(__file__).resolve().with_name("cost_table.json")
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Figure:
    """A measured value and where it comes from."""

    value: float
    source: str


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one rank's step, and how they add up."""

    seconds: float
    compute_s: float
    transfer_s: float
    rate: Figure
    bandwidth: Figure | None


# ---- the measured figures ----------------------------------------------------------------
@functools.cache
def load_table(path: Path = TABLE) -> dict:
    return json.loads(Path(path).read_text())


def measured_device(path: Path = TABLE) -> str:
    """The GPU the predictions are for: the table's first device."""
    return next(iter(load_table(path)["devices"]))


def _part(name: str, path: Path) -> dict:
    device = measured_device(path)
    part = load_table(path)["devices"][device].get(name)
    if part is None:
        raise ValueError(f"{Path(path).name} has no {name} figures of {device}; write them "
                         f"with python -m benchmarks.cost_table")
    return part


def auto_kernel(head_dim: int, causal: bool, path: Path = TABLE) -> str:
    """The kernel ``auto`` ranks first on the measured GPU."""
    device = measured_device(path)
    sm = load_table(path)["devices"][device].get("sm") or "sm90"
    gpu = ranking.Device(device, (int(sm[2:-1]), int(sm[-1])))
    return ranking.rank(ranking.load_table(), gpu, head_dim, causal).order[0]


def _interpolate(points: dict[int, float], length: int) -> float:
    """The value at ``length`` on the line through ``points`` in log(length), held at the ends."""
    xs = sorted(points)
    if length <= xs[0]:
        return points[xs[0]]
    if length >= xs[-1]:
        return points[xs[-1]]
    hi = next(i for i, x in enumerate(xs) if x >= length)
    a, b = xs[hi - 1], xs[hi]
    t = (math.log(length) - math.log(a)) / (math.log(b) - math.log(a))
    return points[a] + t * (points[b] - points[a])


def rate(kernel: str, head_dim: int, causal: bool, mode: str, length: int,
         path: Path = TABLE) -> Figure:
    """TFLOP/s of ``kernel`` on one GPU, at the nearest measured head dim."""
    part = _part("kernels", path)
    entries = [e for e in part["figures"]
               if (e["kernel"], e["causal"], e["mode"]) == (kernel, causal, mode)]
    if not entries:
        measured = sorted({e["kernel"] for e in part["figures"]})
        raise ValueError(f"the cost table has no {mode} figures of kernel {kernel!r}; choose "
                         f"one of the measured kernels {measured}")
    entry = min(entries, key=lambda e: (abs(e["head_dim"] - head_dim), e["head_dim"]))
    value = _interpolate(dict(zip(entry["seq_lens"], entry["tflops"])), length)
    mask = "causal" if causal else "full"
    return Figure(value * 1e12, f"{kernel} on one GPU, hd {entry['head_dim']} {mask} {mode} at "
                                f"{_short(length)} tokens: {value:.0f} TFLOP/s "
                                f"({part['source']['file']})")


def _link(transport: str, block_bytes: float, path: Path) -> tuple[Figure, float]:
    """(bytes/s of one ring shift of ``block_bytes`` alone, the share of its time that
    attention running beside it does not hide)."""
    part = _part("ring_shifts", path)
    measured = {e["transport"] for e in part["figures"]}
    impl = transport if transport in measured else "p2p"
    shifts = [e for e in part["figures"] if e["transport"] == impl]
    gbps = _interpolate({e["block_bytes"]: e["gbps"] for e in shifts}, block_bytes)
    unhidden = _interpolate({e["block_bytes"]: e["unhidden"] for e in shifts
                             if e["unhidden"] is not None}, block_bytes)
    source = (f"transfers of {block_bytes / 2**20:.0f} MiB at the {impl} ring-shift figures: "
              f"{gbps:.0f} GB/s alone, {unhidden:.0%} of a shift's time not hidden by attention "
              f"({part['source']['file']})")
    return Figure(gbps * GB, source), unhidden


# ---- the model ---------------------------------------------------------------------------
def dims_of(plan) -> list:
    """The Description of every mesh dim of a rank's plan."""
    d = plan.description
    if getattr(d, "dims", None):
        return [dim.description for dim in d.dims]
    return [d]


def overlap(description) -> Overlap:
    """What the schedule that wrote ``description`` states of its transfers (the cautious
    default when no registered schedule has its name)."""
    return overlap_of(_class(description.schedule) if description.schedule in names() else None)


def call_length(plan, spec) -> int:
    """Keys per kernel call: S over the ranks of the dims whose schedule splits the keys."""
    blocks = math.prod(d.ranks for d in dims_of(plan) if overlap(d).splits_keys)
    return max(spec.kv_len // blocks, 1)


def step_time(plan, spec, *, mode: str, kernel: str, transport: str = "auto",
              path: Path = TABLE) -> StepTime:
    """Predicted seconds of one rank's forward (``mode="fwd"``) or forward+backward step;
    ``transport`` is the schedule's option (``auto``: copy engines, GPUs of one host)."""
    backward = mode == "fwd+bwd"
    d = plan.description
    flops = d.flops + (d.backward_flops if backward else 0.0)
    r = rate(kernel, spec.head_dim, spec.causal, mode, call_length(plan, spec), path)
    compute = flops / r.value
    transfers, link = 0.0, None
    for dim in dims_of(plan):
        received = dim.bytes_received + (dim.backward_bytes_received if backward else 0)
        if not received:
            continue
        stated = overlap(dim)
        shifts = max(dim.steps - 1, 1) * (2 if backward else 1)
        link, unhidden = _link(_transport(stated, transport), received / shifts, path)
        b = received / link.value
        transfers += max(unhidden * b, b - compute * stated.hidden(dim.ranks))
    return StepTime(compute + transfers, compute, transfers, r, link)


def _transport(stated: Overlap, transport: str) -> str:
    """The measured transport a dim's transfers go by: the schedule's own (``auto`` is copy
    engines: GPUs of one host), NCCL send/receive for collectives."""
    if not stated.own_transport:
        return "p2p"
    return "copy_engine" if transport == "auto" else transport


def _short(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
