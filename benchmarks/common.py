"""Shared helpers of the benchmarks: inputs, timing, FLOP/s, memory, environment, output.

Timing follows the usual rules for asynchronous devices: warm up first (so that kernel
selection, cuDNN plan building and nvFuser compilation stay out of the numbers), record a
CUDA event pair around every iteration, report the median, and rotate among several input
sets when one set would fit in the L2 cache. FLOPs are ``AttentionSpec.flops``:
4*b*h*s_q*s_kv*e (halved when causal) for the forward, 3.5x that for forward+backward.

Every benchmark produces a *record*: a dict with a title, the environment it ran in, its
settings, and ``rows``, one per measurement, each with at least ``panel`` (the case: head dim,
mask, mode ...), ``impl`` (what ran), ``seq_len``, ``status`` and, when it ran, ``median_ms``
and ``tflops`` (per GPU). ``save`` writes it as JSON and draws it as a PNG.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch

from benchmarks import telemetry

COMMITTED_RESULTS = Path(__file__).resolve().parent / "results"


def default_results_dir() -> Path:
    """Where results go by default: ``benchmarks/results`` in a source checkout (beside the
    committed ones), the current directory when the package is installed."""
    checkout = (Path(__file__).resolve().parent.parent / "pyproject.toml").is_file()
    return COMMITTED_RESULTS if checkout else Path.cwd()


RESULTS_DIR = default_results_dir()
GIB = float(1 << 30)


# ---- arguments --------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    """'4k,8192,1M' -> [4096, 8192, 1048576] (k and M are powers of two)."""
    scale = {"k": 1 << 10, "m": 1 << 20}
    values = []
    for item in text.split(","):
        item = item.strip().lower()
        values.append(int(item[:-1]) * scale[item[-1]] if item[-1] in scale else int(item))
    return values


def add_output_args(parser) -> None:
    """--results-dir and --copy-to (a second folder for the JSON and PNG; default $OUT)."""
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="where <name>.json and <name>.png go (default: %(default)s)")
    parser.add_argument("--copy-to", default=os.environ.get("OUT", ""),
                        help="also copy the JSON and PNG here ($OUT when set; '' for none)")


def add_distributed_args(parser) -> None:
    """Options shared by the benchmarks that run under mpirun, then --results-dir/--copy-to."""
    parser.add_argument("--sync-each", action="store_true",
                        help="barrier (one GPU: synchronize) before every timed iteration")
    parser.add_argument("--timeout-s", type=float, default=300, help="collective timeout")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="stop starting new cases after this long (0: no limit)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU ranks (gloo)")
    add_output_args(parser)


def short(n: int) -> str:
    """4096 -> '4K', 1048576 -> '1M'."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


class Deadline:
    """A wall-clock budget: ``left()`` seconds remain; None means no limit."""

    def __init__(self, seconds: float | None):
        self.end = None if not seconds else time.monotonic() + seconds

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()


# ---- inputs -----------------------------------------------------------------------------
def random_inputs(batch: int, heads: int, seq_len: int, head_dim: int, *, dtype, device,
                  layout: str = "bhse", seed: int = 0, requires_grad: bool = True):
    """(q, k, v, dout): standard-normal tensors of logical shape [B, H, S, E] in ``layout``.

    The same seed gives the same values on every rank. q, k, v require grad when asked;
    dout never does.
    """
    from sdpa_fusion.layout import Layout

    layout = Layout.of(layout)
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = []
    for i in range(4):
        t = layout.empty((batch, heads, seq_len, head_dim), dtype=dtype, device=device)
        t.normal_(generator=generator)
        tensors.append(t.requires_grad_(requires_grad and i < 3))
    return tuple(tensors)


def rotation_count(set_bytes: int, device, most: int = 4) -> int:
    """Input sets to rotate among so that consecutive iterations never hit a warm L2 cache:
    enough sets to cover twice the cache, at most ``most``."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    cache = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
    return max(1, min(most, math.ceil(2 * cache / max(set_bytes, 1))))


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp32 (NaN when x has NaNs)."""
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


# ---- timing -----------------------------------------------------------------------------
@dataclasses.dataclass
class Measurement:
    """One timed run of one step. Times in ms; memory in GiB."""

    status: str = "ok"            # ok | unavailable | oom | error | skipped
    error: str | None = None
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    warmup: int = 0
    iters: int = 0
    input_sets: int = 1
    peak_gib: float | None = None  # torch.cuda.max_memory_allocated over the timed iterations
    step_gib: float | None = None  # that peak minus what was allocated before: the step's own
    hold_s: float = 0.0  # seconds of steps run back to back before the timed ones
    gpus: dict | None = None  # the GPUs' clocks over the timed iterations (telemetry.summarize)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure(step: Callable, input_sets: Sequence, *, warmup: int = 3, iters: int = 10,
            min_iters: int = 3, budget_s: float | None = None,
            before_timing: Callable | None = None,
            before_each: Callable | None = None, hold_s: float = 0.0,
            agree: Callable[[bool], bool] | None = None) -> Measurement:
    """Time ``step(inputs)`` rotating over ``input_sets``; never raises.

    ``warmup`` untimed calls come first. With ``budget_s`` the number of timed iterations is cut
    (down to ``min_iters``) so that they take about that long, estimated from the warm-up calls
    after the first (which may compile; a warm-up of one call gets one more); leave it None when
    several ranks must run the same number of iterations. With ``hold_s`` steps then run back to
    back for about that many seconds more, untimed, so that the timed ones find the GPU at the
    clock it keeps under sustained load (a power or thermal limit takes a while to settle);
    ``agree(go)`` makes the ranks of a distributed step decide together when to stop (True while
    any rank goes on). Timed iterations run back to back (the steady state of a training loop:
    host work overlaps the device's) after ``before_timing`` (a barrier, say); ``before_each``
    runs before every timed iteration, outside the timed region, instead. On GPUs ``gpus``
    records their clocks over the timed iterations (``telemetry``). A failure is returned as a
    Measurement whose status says what went wrong.
    """
    try:
        return _measure(step, list(input_sets), warmup, iters, min_iters, budget_s,
                        before_timing, before_each, hold_s, agree)
    except Exception as e:  # noqa: BLE001 -- every failure becomes a row in the results
        return failure(e)


def _measure(step, sets, warmup, iters, min_iters, budget_s, before_timing,
             before_each, hold_s, agree) -> Measurement:
    cuda = _on_cuda(sets[0])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sampler = telemetry.sampler() if cuda else None  # started before it is needed
    seconds = []

    def untimed(i: int) -> None:
        sync()
        t0 = time.perf_counter()
        step(sets[i % len(sets)])
        sync()
        seconds.append(time.perf_counter() - t0)

    for i in range(warmup):
        untimed(i)
    if budget_s is not None and seconds:
        if len(seconds) == 1:  # the first call may compile: the estimate takes one more
            untimed(1)
        estimate = min(seconds[1:])
        iters = max(min_iters, min(iters, int(budget_s / max(estimate, 1e-6))))
    if hold_s > 0:
        _hold(step, sets, hold_s, sync, agree)
    base = None
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    if before_timing is not None:
        before_timing()
    start = time.time()
    times = _timed(step, sets, iters, before_each, cuda)
    m = Measurement(
        median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
        warmup=warmup, iters=iters, input_sets=len(sets), hold_s=hold_s,
        gpus=sampler.between(start, time.time()) if sampler is not None else None,
    )
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        m.peak_gib, m.step_gib = peak / GIB, (peak - base) / GIB
    return m


def _hold(step, sets, seconds, sync, agree) -> None:
    """Steps back to back for about ``seconds``, in rounds of four (every rank of a
    distributed step takes as many: ``agree`` decides after each round)."""
    start, i = time.perf_counter(), 0
    while True:
        for _ in range(4):
            step(sets[i % len(sets)])
            i += 1
        sync()
        go = time.perf_counter() - start < seconds
        if not (agree(go) if agree is not None else go):
            return


def _timed(step, sets, n, before_each, cuda) -> list[float]:
    if not cuda:
        times = []
        for i in range(n):
            if before_each is not None:
                before_each()
            t0 = time.perf_counter()
            step(sets[i % len(sets)])
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    for i, (start, end) in enumerate(events):
        if before_each is not None:
            before_each()
        start.record()
        step(sets[i % len(sets)])
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _on_cuda(inputs) -> bool:
    tensors = inputs if isinstance(inputs, (tuple, list)) else [inputs]
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)


def failure(e: BaseException) -> Measurement:
    """A Measurement recording exception ``e``: oom, unavailable (the kernel or feature is
    missing) or error."""
    name = type(e).__name__
    if isinstance(e, torch.cuda.OutOfMemoryError):
        status = "oom"
        torch.cuda.empty_cache()
    elif isinstance(e, (NotImplementedError, ImportError)) or name == "KernelUnavailable":
        status = "unavailable"
    else:
        status = "error"
    text = " ".join(str(e).split())
    return Measurement(status=status, error=f"{name}: {text}"[:600])


def combine_ranks(per_rank: Sequence[Measurement]) -> Measurement:
    """One Measurement for a step run on several ranks: the first failure if any rank failed,
    else the slowest rank's times and the largest memory."""
    for rank, m in enumerate(per_rank):
        if m.status != "ok":
            return dataclasses.replace(m, error=f"rank {rank}: {m.error}")
    slowest = max(per_rank, key=lambda m: m.median_ms)
    if slowest.peak_gib is None:
        return slowest
    return dataclasses.replace(slowest, peak_gib=max(m.peak_gib or 0.0 for m in per_rank),
                               step_gib=max(m.step_gib or 0.0 for m in per_rank))


def ratios(rows: Sequence[dict], baseline: Callable[[dict], str | Sequence[str] | None], *,
           same: Sequence[str] = ("panel", "seq_len"), value: str = "tflops",
           base_value: str | None = None, every: bool = False,
           entry: Callable[[dict, dict, float | None], dict] | None = None) -> list[dict]:
    """Each row's ``value`` over its baseline row's ``base_value`` (default: ``value``), the
    baseline taken among the rows that share the row's fields ``same``.

    ``baseline(row)`` names the impl a row is compared with, or several (the one with the
    largest ``base_value`` is taken, the first of equals), or None (the row gets no entry).
    One entry per row, in the order of the rows (a later row of the same fields and impl
    replaces an earlier one, in its place), made by ``entry(row, baseline row, ratio)``; by
    default ``{<same fields>, "impl", "ratio", "status": "ok", "baseline": <its impl>}``.
    Rows and baselines whose value is missing (None or 0) are left out; with ``every`` they
    are kept (the ratio is then None) as long as the baseline impl has a row.
    """
    base_value = base_value or value
    rows_at: dict[tuple, dict] = {}
    for r in rows:
        if every or r.get(value) or r.get(base_value):
            rows_at[tuple(r.get(k) for k in same), r["impl"]] = r
    out = []
    for (key, _), r in rows_at.items():
        wanted = baseline(r)
        if wanted is None or not (every or r.get(value)):
            continue
        names = [wanted] if isinstance(wanted, str) else wanted
        found = [rows_at[key, n] for n in names if (key, n) in rows_at
                 and (every or rows_at[key, n].get(base_value))]
        if not found:
            continue
        base = max(found, key=lambda b: b.get(base_value) or 0)
        ratio = r[value] / base[base_value] if r.get(value) and base.get(base_value) else None
        out.append(entry(r, base, ratio) if entry is not None else
                   {**{k: r.get(k) for k in same}, "impl": r["impl"], "ratio": ratio,
                    "status": "ok", "baseline": base["impl"]})
    return out


def tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def make_row(panel: str, impl: str, seq_len: int, m: Measurement, flops: float, **fields) -> dict:
    """A result row; ``flops`` is the work of one GPU for one step."""
    row = {"panel": panel, "impl": impl, "seq_len": seq_len, **fields, **m.as_dict()}
    row["tflops"] = tflops(flops, m.median_ms) if m.status == "ok" else None
    return row


def run(main: Callable[[], int]) -> None:
    """Run a benchmark's ``main`` and end the process with its status (1 after an uncaught
    exception, whose traceback is printed), through ``finish``."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 -- report, then end with a failing status
        traceback.print_exc()
        code = 1
    finish(code)


def finish(code: int = 0) -> None:
    """End the process with ``code``. Once nvFuser's multidevice support has been used, its
    communicator aborts in its destructor at interpreter exit (CPU ranks have no CUDA driver;
    the torch-2.10 build aborts under torch 2.11), so skip interpreter teardown then, after
    finalizing MPI (mpirun reports a rank that exits without MPI_Finalize as failed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "nvfuser_direct" not in sys.modules:
        sys.exit(code)
    if "mpi4py.MPI" in sys.modules:
        mpi = sys.modules["mpi4py.MPI"]
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    os._exit(code)


# ---- environment ------------------------------------------------------------------------
def environment(module: str) -> dict:
    """Where and how this run happened: date, command, devices, library versions."""
    world = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("WORLD_SIZE")
    launcher = f"mpirun -np {world} " if os.environ.get("OMPI_COMM_WORLD_SIZE") else ""
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"{launcher}python -m {module} {shlex.join(sys.argv[1:])}".strip(),
        "world_size": int(world) if world else 1,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": _nccl_version(),
        "nvfuser": _nvfuser_version(),
        "flash_attn_4": _distribution_version("flash-attn-4"),
        "git_commit": _git_commit(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update({
            "device": torch.cuda.get_device_name(0),
            "device_count": torch.cuda.device_count(),
            "capability": "sm%d%d" % torch.cuda.get_device_capability(0),
            "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / GIB, 1),
            "l2_mib": round(getattr(props, "L2_cache_size", 0) / (1 << 20), 1),
            "nvidia_smi": _nvidia_smi(),
        })
    else:
        env.update({"device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
                    "device_count": 0})
    return env


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 -- a build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _nvfuser_version() -> str | None:
    """The installed nvfuser_direct distribution's version, without importing it."""
    try:
        dists = importlib.metadata.packages_distributions().get("nvfuser_direct") or []
        if dists:
            return f"{dists[0]} {importlib.metadata.version(dists[0])}"
    except Exception:  # noqa: BLE001
        pass
    module = sys.modules.get("nvfuser_direct")
    return getattr(module, "__version__", None) if module else None


def _distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name``, without importing it (None if absent)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The checkout's commit, with ``-dirty`` when the working tree differs from it; or
    ``SDPA_FUSION_GIT_COMMIT`` when set (a copy of a checkout whose history is not there)."""
    if os.environ.get("SDPA_FUSION_GIT_COMMIT"):
        return os.environ["SDPA_FUSION_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                             capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 -- no git, or not a checkout
        return None


def _nvidia_smi() -> list[str] | None:
    """Clocks, power and temperature of every GPU at the start (a read-only query)."""
    query = "index,name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        return [query] + out.stdout.strip().splitlines() if out.returncode == 0 else None
    except Exception:  # noqa: BLE001 -- no nvidia-smi
        return None


# ---- output -----------------------------------------------------------------------------
def save(name: str, record: dict, output, *, plot: bool = True,
         metrics: Sequence[str] = ("tflops",), bars: bool = False) -> list[Path]:
    """Write ``<name>.json`` (and ``<name>.png`` when ``plot``: lines over sequence lengths,
    or with ``bars`` one bar per impl and panel) into ``output.results_dir``, and copy them
    into ``output.copy_to`` when it is set (``output``: the options of ``add_output_args``).
    Returns the paths written."""
    results_dir, copy_to = Path(output.results_dir), output.copy_to
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    tmp.replace(path)
    paths = [path]
    if plot:
        try:
            draw = plot_bars if bars else plot_record
            paths.append(draw(record, results_dir / f"{name}.png", metrics=metrics))
        except Exception as e:  # noqa: BLE001 -- the JSON matters more than the picture
            print(f"warning: could not draw {name}.png: {type(e).__name__}: {e}", file=sys.stderr)
    copy_files(paths, copy_to)
    return paths


def copy_files(paths: Sequence[Path], folder: str | None) -> None:
    """Copy ``paths`` into ``folder`` (nothing when it is empty or None)."""
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    for p in paths:
        shutil.copy2(p, Path(folder) / Path(p).name)


METRIC_LABELS = {
    "tflops": "TFLOP/s per GPU",
    "peak_gib": "peak memory per GPU (GiB)",
    "step_gib": "memory of the step per GPU (GiB)",
    "median_ms": "time (ms)",
    "gbps": "transfer rate (GB/s)",
    "host_us": "host time per call (us)",
    "device_us": "device time per call (us)",
}


def plot_record(record: dict, path: Path, *, metrics: Sequence[str] = ("tflops",)) -> Path:
    """Draw ``metric`` against sequence length, one line per impl and one panel per case
    (``row["panel"]``), one row of panels per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    metrics = [m for m in metrics if any(r.get(m) is not None for r in rows)] or list(metrics[:1])
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    kinds = list(dict.fromkeys(_color_key(impl) for impl in impls))
    palette = plt.get_cmap("tab10" if len(kinds) <= 10 else "tab20")
    colors = {impl: palette(kinds.index(_color_key(impl)) % palette.N) for impl in impls}
    ncols = min(4, len(panels))
    per_metric = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(per_metric * len(metrics), ncols, squeeze=False,
                             figsize=(max(4.4 * ncols, 10.0), 3.5 * per_metric * len(metrics)))
    for ax in axes.flat:
        ax.set_visible(False)
    seq_lens = sorted({r["seq_len"] for r in rows})
    for m_i, metric in enumerate(metrics):
        for p_i, panel in enumerate(panels):
            ax = axes[m_i * per_metric + p_i // ncols][p_i % ncols]
            ax.set_visible(True)
            for impl in impls:
                points = sorted((r["seq_len"], r[metric]) for r in rows
                                if r["panel"] == panel and r["impl"] == impl
                                and r.get("status") == "ok" and r.get(metric) is not None)
                if points:
                    ax.plot(*zip(*points), marker="o", markersize=3.5, label=impl,
                            color=colors[impl], linestyle=_line_style(impl))
            ax.set_xscale("log", base=2)
            ax.set_xlim(min(seq_lens) / 1.25, max(seq_lens) * 1.25)
            ax.set_xticks(seq_lens, [short(s) for s in seq_lens])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(panel, fontsize=10)
            ax.set_xlabel("sequence length", fontsize=9)
            ax.set_ylabel(METRIC_LABELS.get(metric, metric), fontsize=9)
            ax.grid(alpha=0.3)
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    legend_rows = math.ceil(len(handles) / 5)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(5, len(handles)),
               fontsize=9, frameon=False)
    env = record.get("environment", {})
    fig.suptitle(f"{record.get('title', path.stem)} ({env.get('device', '?')}, "
                 f"torch {env.get('torch', '?')})", fontsize=11)
    bottom = min(0.3, (0.05 + 0.035 * legend_rows) / max(1, per_metric * len(metrics)) * 2)
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(record: dict, path: Path, *, metrics: Sequence[str] = ("tflops",)) -> Path:
    """One panel per case (``row["panel"]``) and metric, one labelled bar per impl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if r.get("status") == "ok"]
    metrics = [m for m in metrics if any(r.get(m) is not None for r in rows)] or list(metrics[:1])
    panels = list(dict.fromkeys(r["panel"] for r in record["rows"]))
    fig, axes = plt.subplots(len(metrics), len(panels), squeeze=False,
                             figsize=(max(4.4 * len(panels), 10.0), 4.2 * len(metrics)))
    for (m_i, metric), (p_i, panel) in itertools.product(enumerate(metrics), enumerate(panels)):
        ax = axes[m_i][p_i]
        cells = [(r["impl"], r[metric]) for r in rows
                 if r["panel"] == panel and r.get(metric) is not None]
        if cells:
            bars = ax.bar(range(len(cells)), [v for _, v in cells])
            ax.bar_label(bars, [number(v) for _, v in cells], fontsize=8)
            ax.set_xticks(range(len(cells)), [impl for impl, _ in cells], rotation=30,
                          ha="right", fontsize=8)
        ax.set_title(panel, fontsize=10)
        ax.set_ylabel(METRIC_LABELS.get(metric, metric), fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    env = record.get("environment", {})
    fig.suptitle(f"{record.get('title', path.stem)} ({env.get('device', '?')}, "
                 f"torch {env.get('torch', '?')})", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _color_key(impl: str) -> str:
    """Lines of one kernel share a color: "1 GPU auto" and "head_parallel auto" -> "auto"."""
    for prefix in ("1 GPU ", "head_parallel "):
        if impl.startswith(prefix):
            return impl[len(prefix):]
    return impl


def _line_style(impl: str) -> str:
    if impl.startswith("torch"):
        return "--"
    if impl.startswith("1 GPU"):
        return ":"
    return "-"


def format_table(rows: Sequence[dict], *, row_keys: Sequence[str], col_key: str = "impl",
                 value: str = "tflops", fmt: str | None = None) -> str:
    """A text table: one line per distinct ``row_keys``, one column per ``col_key``; failed
    cells show their status."""
    cols = list(dict.fromkeys(r[col_key] for r in rows))
    lines = list(dict.fromkeys(tuple(r[k] for k in row_keys) for r in rows))
    cells = {}
    for r in rows:
        key = (tuple(r[k] for k in row_keys), r[col_key])
        v = r.get(value)
        cells[key] = number(v, fmt) if r.get("status") == "ok" else r.get("status", "-")
    header = [*row_keys, *cols]
    body = [[_cell(v) for v in line] + [cells.get((line, c), "") for c in cols] for line in lines]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *body)]
    out = ["  ".join(str(x).rjust(w) for x, w in zip(header, widths))]
    out += ["  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in body]
    return "\n".join(out)


def number(v: float | None, fmt: str | None = None) -> str:
    """``v`` with ``fmt``, or with 3 significant digits (no decimals from 100 up)."""
    if v is None:
        return "-"
    if fmt is not None:
        return fmt.format(v)
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _cell(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int) and v >= 1024:
        return short(v)
    return str(v)


def print_failures(rows: Sequence[dict]) -> None:
    """One line per distinct (impl, status, error) among the rows that did not run."""
    seen = {}
    for r in rows:
        if r.get("status") not in ("ok", None):
            seen.setdefault((r["impl"], r["status"], r.get("error")), []).append(r)
    for (impl, status, error), group in seen.items():
        print(f"{status}: {impl} ({len(group)} rows): {error}")
