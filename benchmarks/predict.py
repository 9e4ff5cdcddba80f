"""Predicted step times of a schedule, from the committed benchmark results, and the last
measurement of the same configuration.

The model takes what ``describe()`` says one rank does (FLOPs, bytes received) and three
kinds of measured figures, all read from ``benchmarks/results``:

    rate       the kernel's TFLOP/s on one GPU for the same head dim, mask and mode at the
               length of the rank's kernel calls (``single_gpu.json``; interpolated in
               log(length), held at the ends): S/P for ring and allgather blocks, S for
               Ulysses and head_parallel (all tokens, fewer heads)
    bandwidth  GB/s of one ring shift alone, per transport and block size
               (``ring_transport.json``, "alone"); collectives use the p2p figure
    overlap    how much a shift still costs while attention runs beside it: (attention with
               the shift - attention alone) / shift alone (``ring_transport.json``, "during
               attention")

    compute  c = FLOPs / rate
    each dim's transfers b = bytes received / bandwidth add
        ring       max(overlap * b, b - c (P-1)/P)   (every step but the last hides a shift)
        allgather  max(overlap * b, b - c / P)       (the own block hides the gather)
        ulysses    b                                 (all-to-alls before and after)
    time = c + the transfers of every mesh dim

The kernel is the one ``auto`` ranks first on the measured GPU (``measured_tflops.json``)
unless one is named; a measurement is compared with a prediction for the kernel it ran on
(``auto`` was cuDNN before FlashAttention-4 was installed with the benchmarks).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN = {  # share of the compute that can run while a dim's transfers move, over P ranks
    "ring": lambda p: (p - 1) / p,
    "allgather": lambda p: 1 / p,
}
BLOCKED = ("ring", "allgather")  # schedules whose kernel calls see S/P keys per block
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


@dataclasses.dataclass(frozen=True)
class Measured:
    """A committed measurement of one configuration."""

    median_ms: float
    tflops: float
    peak_gib: float | None
    kernel: str
    options: dict  # the schedule's options that change its cost (the ring's transport)
    file: str
    date: str
    command: str
    device: str


# ---- the committed figures ---------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def records(results_dir: Path = RESULTS) -> tuple[tuple[str, dict], ...]:
    """(file name, record) of every committed result (``*_tiny.json`` left out)."""
    found = []
    for path in sorted(Path(results_dir).glob("*.json")):
        if not path.stem.endswith("_tiny"):
            found.append((path.name, json.loads(path.read_text())))
    return tuple(found)


def _record(name: str, results_dir: Path) -> dict:
    for file, record in records(results_dir):
        if file == name:
            return record
    raise ValueError(f"{name} is not among the benchmark results in {results_dir}; run the "
                     f"benchmark that writes it (benchmarks/README.md)")


def measured_device(results_dir: Path = RESULTS) -> str:
    """The GPU the one-GPU figures were measured on."""
    return _record("single_gpu.json", results_dir)["environment"]["device"]


def auto_kernel(head_dim: int, causal: bool, results_dir: Path = RESULTS) -> str:
    """The kernel ``auto`` ranks first on the GPU of the committed results."""
    from sdpa_fusion.kernels import ranking

    env = _record("single_gpu.json", results_dir)["environment"]
    sm = env.get("capability", "sm90")
    device = ranking.Device(env["device"], (int(sm[2:-1]), int(sm[-1])))
    return ranking.rank(ranking.load_table(), device, head_dim, causal).order[0]


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
         results_dir: Path = RESULTS) -> Figure:
    """TFLOP/s of ``kernel`` on one GPU (single_gpu.json), at the nearest measured head dim."""
    rows = [r for r in _record("single_gpu.json", results_dir)["rows"]
            if r["impl"] == kernel and r["causal"] == causal and r["mode"] == mode
            and r.get("tflops")]
    if not rows:
        raise ValueError(f"single_gpu.json has no {mode} measurement of kernel {kernel!r}; "
                         f"choose one of the measured kernels (cudnn, fa4, flash, nvfuser)")
    hd = min({r["head_dim"] for r in rows}, key=lambda d: (abs(d - head_dim), d))
    points = {r["seq_len"]: r["tflops"] for r in rows if r["head_dim"] == hd}
    value = _interpolate(points, length)
    mask = "causal" if causal else "full"
    return Figure(value * 1e12, f"{kernel} on one GPU, hd {hd} {mask} {mode} at "
                                f"{_short(length)} tokens: {value:.0f} TFLOP/s (single_gpu.json)")


def _transport_rows(results_dir: Path) -> list[dict]:
    return [r for r in _record("ring_transport.json", results_dir)["rows"] if r.get("median_ms")]


def _link(transport: str, block_bytes: float, results_dir: Path) -> tuple[Figure, float]:
    """(bytes/s of one ring shift of ``block_bytes`` alone, the share of its time that
    attention running beside it does not hide)."""
    rows = _transport_rows(results_dir)
    impl = transport if transport in {r["impl"] for r in rows} else "p2p"
    alone = {r["block_bytes"]: r for r in rows if r["panel"] == "alone" and r["impl"] == impl}
    during = {r["block_bytes"]: r["median_ms"] for r in rows
              if r["panel"] == "during attention" and r["impl"] == impl}
    attention = {r["block_bytes"]: r["median_ms"] for r in rows
                 if r["panel"] == "during attention" and r["impl"] == "attention alone"}
    gbps = _interpolate({b: r["gbps"] for b, r in alone.items()}, block_bytes)
    overlap = _interpolate({b: min(1.0, max(0.0, (during[b] - attention[b]) / r["median_ms"]))
                            for b, r in alone.items() if b in during and b in attention},
                           block_bytes)
    source = (f"transfers of {block_bytes / 2**20:.0f} MiB at the {impl} ring-shift figures: "
              f"{gbps:.0f} GB/s alone, {overlap:.0%} of a shift's time not hidden by attention "
              f"(ring_transport.json)")
    return Figure(gbps * GB, source), overlap


# ---- the model ---------------------------------------------------------------------------
def dims_of(plan) -> list[tuple[str, object]]:
    """(schedule name, Description) of every mesh dim of a rank's plan."""
    d = plan.description
    if getattr(d, "dims", None):
        return [(dim.description.schedule, dim.description) for dim in d.dims]
    return [(d.schedule, d)]


def call_length(plan, spec) -> int:
    """Tokens per kernel call's key block: S over the ranks of ring or allgather dims."""
    blocks = 1
    for name, description in dims_of(plan):
        if name in BLOCKED:
            blocks *= description.ranks
    return max(spec.kv_len // blocks, 1)


def step_time(plan, spec, *, mode: str, kernel: str, transport: str = "auto",
              results_dir: Path = RESULTS) -> StepTime:
    """Predicted seconds of one rank's forward (``mode="fwd"``) or forward+backward step."""
    backward = mode == "fwd+bwd"
    d = plan.description
    flops = d.flops + (d.backward_flops if backward else 0.0)
    r = rate(kernel, spec.head_dim, spec.causal, mode, call_length(plan, spec), results_dir)
    compute = flops / r.value
    transfers, link = 0.0, None
    for name, dim in dims_of(plan):
        received = dim.bytes_received + (dim.backward_bytes_received if backward else 0)
        if not received:
            continue
        shifts = max(dim.steps - 1, 1) * (2 if backward else 1)
        link, overlap = _link(_link_of(name, transport), received / shifts, results_dir)
        b = received / link.value
        hidden = HIDDEN.get(name)
        transfers += b if hidden is None else max(overlap * b, b - compute * hidden(dim.ranks))
    return StepTime(compute + transfers, compute, transfers, r, link)


def _link_of(schedule: str, transport: str) -> str:
    """The measured transport a dim's transfers go by: the ring's own (``auto`` is copy
    engines: GPUs of one host), NCCL's send/receive figures for the collectives."""
    if schedule != "ring":
        return "p2p"
    return "copy_engine" if transport == "auto" else transport


# ---- measurements ------------------------------------------------------------------------
def _configuration(row: dict) -> tuple[str, dict] | None:
    """(schedule, options) that a result row measured; None for rows of other things."""
    impl = row["impl"]
    words = impl.split()
    if impl in ("1 GPU auto", "auto") and row.get("ranks", 1) == 1:
        return "replicated", {}
    if words[0] == "ring":
        return "ring", {"transport": _transport(row)}
    if impl in ("allgather", "ulysses", "head_parallel auto"):
        return words[0], {}
    if words[0] == "hybrid":
        return "hybrid", {"inner": words[1], "shape": tuple(int(x) for x in words[2].split("x"))}
    return None


def _transport(row: dict) -> str:
    """The transport a ring row ran with: named in the row, else copy engines when it held
    symmetric memory, else NCCL send/receive (the ring before it had transports)."""
    named = (row.get("options") or {}).get("transport") or row["impl"].partition(" ")[2]
    return named or ("copy_engine" if row.get("symmetric_gib") else "p2p")


def _kernel_of(record: dict) -> str:
    """The kernel ``auto`` ran on in a recorded run: FlashAttention-4 when it was installed."""
    return "fa4" if record["environment"].get("flash_attn_4") else "cudnn"


def measurements(name: str, shape: tuple[int, ...], spec, mode: str, options: dict,
                 results_dir: Path = RESULTS) -> list[Measured]:
    """Committed measurements of schedule ``name`` with ``options`` on a mesh of ``shape``
    for ``spec`` (b, h, s, e, causal, window) in ``mode``, oldest first."""
    found = []
    ranks = math.prod(shape)
    for file, record in records(results_dir):
        env = record.get("environment", {})
        for row in record.get("rows", ()):
            config = _configuration(row) if "impl" in row else None
            if (config is None or config[0] != name or row.get("status") != "ok"
                    or "baseline_from" in row):  # a copy of another file's measurement
                continue
            got = config[1]
            if name == "hybrid" and (got["inner"] != options.get("inner", "ulysses")
                                     or got["shape"] != tuple(shape)):
                continue
            if name == "ring" and options.get("transport", "auto") not in ("auto", got["transport"]):
                continue
            causal = row.get("causal", str(row.get("panel", "")).startswith("causal"))
            if (row.get("ranks", 1), row.get("batch"), row.get("heads"), row.get("head_dim"),
                    row.get("seq_len"), causal, row.get("mode")) != (
                    ranks, spec.batch, spec.heads, spec.head_dim, spec.q_len, spec.causal, mode):
                continue
            if spec.kv_heads != spec.heads or str(spec.dtype) not in ("torch.bfloat16",):
                continue
            if _window_left(row) != (spec.window.left if spec.window is not None else None):
                continue
            options = {"transport": got["transport"]} if name == "ring" else {}
            found.append(Measured(row["median_ms"], row["tflops"], row.get("peak_gib"),
                                  _kernel_of(record), options, file, env.get("date_utc", ""),
                                  env.get("command", ""), env.get("device", "?")))
    return sorted(found, key=lambda m: m.date)


def _window_left(row: dict) -> int | None:
    """The left side of a measured row's causal window; None for full causal (rows of the
    benchmarks that measure windows say so in ``mask``)."""
    return row.get("window_left") if str(row.get("mask", "")).startswith("window") else None


def age(date: str) -> str:
    """'2026-11-29' from an ISO timestamp."""
    try:
        return datetime.datetime.fromisoformat(date).date().isoformat()
    except ValueError:
        return date or "?"


def _short(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
