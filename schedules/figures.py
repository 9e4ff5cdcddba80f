"""The measured figures of the cost model (``cost_table.json`` beside this module, written by
``python -m benchmarks.cost_table``): a kernel's TFLOP/s, a ring shift's bandwidth, and what a
dim's transfers add beside attention (values interpolated in log(length), held at the ends).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from sdpa_fusion.kernels import ranking

from .overlap import Overlap

TABLE = Path(__file__).resolve().with_name("cost_table.json")
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Figure:
    """A measured value and where it comes from."""

    value: float
    source: str


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
         path: Path = TABLE, *, packed: bool = False) -> Figure:
    """TFLOP/s of ``kernel`` on one GPU, at the nearest measured head dim, for calls of
    ``length`` tokens (``packed``: at the share packed batches reached)."""
    part = _part("kernels", path)
    value, head_dim = dense_rate(part["figures"], kernel, head_dim, causal, mode, length)
    source = (f"{kernel} on one GPU, hd {head_dim} {'causal' if causal else 'full'} {mode} at "
              f"{_short(length)} tokens: {value:.0f} TFLOP/s ({part['source']['file']})")
    if packed:
        shares = _part("packed", path)
        share = _interpolate({e["work_length"]: e["share"] for e in shares["figures"]}, length)
        value *= share
        source += (f", x{share:.2f} for packed documents of {_short(length)} tokens "
                   f"({shares['source']['file']})")
    return Figure(value * 1e12, source)


def work_length(calls) -> int:
    """The mean length of calls of (length, work) pairs, weighted by their work."""
    work = sum(w for _, w in calls)
    return max(round(sum(n * w for n, w in calls) / work), 1) if work else 1


def dense_rate(figures: list[dict], kernel: str, head_dim: int, causal: bool, mode: str,
               length: int) -> tuple[float, int]:
    """(TFLOP/s, the head dim measured) of ``kernel`` in a cost table's kernel ``figures``."""
    entries = [e for e in figures if (e["kernel"], e["causal"], e["mode"]) == (kernel, causal, mode)]
    if not entries:
        measured = sorted({e["kernel"] for e in figures})
        raise ValueError(f"the cost table has no {mode} figures of kernel {kernel!r}; choose "
                         f"one of the measured kernels {measured}")
    entry = min(entries, key=lambda e: (abs(e["head_dim"] - head_dim), e["head_dim"]))
    return _interpolate(dict(zip(entry["seq_lens"], entry["tflops"])), length), entry["head_dim"]


def _link(transport: str, block_bytes: float, path: Path) -> tuple[Figure, float]:
    """(bytes/s of a ring shift of ``block_bytes`` alone, the share attention leaves unhidden)."""
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


def transfer_seconds(dim, stated: Overlap, compute: float, backward: bool, transport: str,
                     path: Path = TABLE) -> tuple[float, Figure]:
    """(seconds one dim's transfers add beside ``compute`` seconds of attention, link figure)."""
    received = dim.bytes_received + (dim.backward_bytes_received if backward else 0)
    shifts = max(dim.steps - 1, 1) * (2 if backward else 1)
    link, unhidden = _link(_transport(stated, transport), received / shifts, path)
    b = received / link.value
    return max(unhidden * b, b - compute * stated.hidden(dim.ranks)), link


def _transport(stated: Overlap, transport: str) -> str:
    """The measured transport of a dim's transfers (``auto``: copy engines; collectives: p2p)."""
    if not stated.own_transport:
        return "p2p"
    return "copy_engine" if transport == "auto" else transport


def _short(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
