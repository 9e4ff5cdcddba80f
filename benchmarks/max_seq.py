"""The longest sequence one training step fits: one GPU, each schedule, PyTorch's context_parallel.

    python -m benchmarks.max_seq --single-gpu           # one GPU, into max_seq.json
    mpirun -np 2 python -m benchmarks.max_seq           # schedules and torch CP, into the same
    mpirun -np 2 python -m benchmarks.max_seq --impls ring                 # a long confirming
    mpirun -np 2 python -m benchmarks.max_seq --impls ulysses,allgather,torch-cp  # step alone
    mpirun -np 2 --oversubscribe python -m benchmarks.max_seq --tiny   # CPU ranks: the script

Every run writes ``max_seq.json`` and ``.png``; a run under mpirun keeps the rows it found
there of the implementations it does not measure (``--merge``): one GPU's, and those of
earlier runs such as a long confirming step of its own.

The problem: b=1, 32 heads of 128, bf16, causal forward+backward (a training step's
attention). Bisecting near a million tokens would take minutes per step, so the limit is
predicted instead: one step at a few probe lengths gives each implementation's memory per GPU
(inputs, the step's own memory and any memory kept outside torch's allocator, such as the
ring's symmetric buffers). For our schedules the prediction follows what ``describe()`` says
a step takes at each length (head groups change with the length, so memory is not a straight
line in it), through the line that best maps the probes' described bytes to their measured
ones (a fixed cost the model leaves out, such as the ring's 128 MiB, stays fixed instead of
growing with the length, as a ratio would make it); for
one GPU and PyTorch's context_parallel a straight line through the probes gives the memory
per token (a probe runs two steps: the second's time counts, the larger memory). The
prediction is the longest length whose memory fits the GPU's free memory. One
step at 95% of the prediction then confirms it (``--confirm``) when the probes' times, grown
with the square of the length, say it takes at most ``--confirm-budget-s``; when it would
take longer, the step runs at the longest length that budget allows (a lower bound on the
limit, marked ``confirmed_full: false``). Its time and memory are recorded. The ratio to one
GPU is given twice: predicted to predicted, and (``confirmed_ratio_to_one_gpu``) what ran to
one GPU's prediction, which no confirmation on one GPU can raise. ``--confirm-lens`` confirms
at the lengths given instead ("does 1.6M tokens run right on one GPU": ``--single-gpu
--confirm-lens 1600k``).

A confirming step counts only when it is right: every rank checks its out, dQ, dK and dV on
sampled rows against fp32 math (``benchmarks.check``); a step past the tolerance has status
"wrong" and confirms nothing. Its row records the errors and the kernel that ran (``plan``).
Inputs are made directly as each rank's shard (never the full tensors), drawn per chunk of
global tokens from a seed (``check.Generated``), so that the check regenerates any rows of the
global problem; PyTorch's context_parallel alone gets full tensors, sharded in place, as its
users give them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import check, common
from benchmarks.context_parallel import impl_options, torch_cp_api

NAME = "max_seq"
SCHEDULES = ("ring", "ulysses", "allgather")
CONFIRM_FRACTION = 0.95
HEADROOM = 0.98  # of the free memory a prediction may plan to use


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--probe-lens", type=common.int_list, default=common.int_list("64k,128k,256k"),
                   help="global sequence lengths of the probe steps")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--impls", default=",".join(SCHEDULES + ("torch-cp",)),
                   help="schedules (schedule[:option=value...]) and 'torch-cp' to measure")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--confirm", default="all",
                   help="implementations to confirm with one step at 95%% of the prediction "
                        "('all', 'none' or a list)")
    p.add_argument("--confirm-budget-s", type=float, default=150,
                   help="the longest a confirming step may be predicted to take (a longer one "
                        "runs at the longest length this allows)")
    p.add_argument("--confirm-lens", type=common.int_list, default=[],
                   help="confirm at these global lengths instead of the predicted one, "
                        "whatever their predicted time (e.g. 1600k; k = 1024)")
    p.add_argument("--layout", choices=("bhse", "bshe"), default="bhse",
                   help="memory order of q, k, v, dout (bshe: [B, S, H, E] buffers)")
    p.add_argument("--seed", type=int, default=0, choices=range(16), metavar="0..15",
                   help="of the inputs (default: %(default)s)")
    p.add_argument("--single-gpu", action="store_true", help="one GPU (no mpirun)")
    p.add_argument("--merge", default=None,
                   help="results (names, comma-separated) whose rows this run's record "
                        "starts with: one GPU's, and implementations measured in other runs "
                        "(default: this run's own result, as an earlier run left it)")
    p.add_argument("--tag", default="",
                   help="appended to the result name, for an ad-hoc run beside the committed one")
    common.add_distributed_args(p)
    args = p.parse_args(argv)
    args.impls = [s for s in args.impls.split(",") if s]
    if args.tiny:  # CPU ranks measure no memory, so predict nothing: confirm at 2K
        args.probe_lens, args.heads, args.head_dim = [256, 512, 1024], 4, 16
        args.confirm_lens = args.confirm_lens or [2048]
    args.name = NAME + args.tag + ("_tiny" if args.tiny else "")
    merge = NAME + args.tag if args.merge is None else args.merge
    args.merge = [m + ("_tiny" if args.tiny else "") for m in merge.split(",") if m]
    return args


def wanted(args, impl: str) -> bool:
    return args.confirm == "all" or impl in args.confirm.split(",")


# ---- one step -----------------------------------------------------------------------------
def generators(args, device) -> list[check.Generated]:
    """q, k, v, dout of the global problem, drawn per chunk of tokens (any rank, any rows)."""
    return [check.Generated(args.heads, args.head_dim, dtype=torch.bfloat16, device=device,
                            seed=args.seed, index=i) for i in range(4)]


def local_inputs(args, positions: torch.Tensor, device):
    """q, k, v (leaves that require grad) and dout of one rank: the global problem's rows
    ``positions``, [1, H, n, E] bf16 in ``args.layout``."""
    from sdpa_fusion.layout import Layout

    shape = (1, args.heads, len(positions), args.head_dim)
    layout = Layout.of(args.layout)
    tensors = [g.into(layout.empty(shape, dtype=torch.bfloat16, device=device), positions)
               for g in generators(args, device)]
    return [t.requires_grad_(i < 3) for i, t in enumerate(tensors)]


def checked(args, s: int, positions, out, grads) -> dict:
    """This rank's check of a step at global length ``s`` (``check.Report.as_dict``)."""
    problem = check.Problem(*generators(args, out.device), seq_len=s, causal=True,
                            scale=args.head_dim ** -0.5)
    start = time.perf_counter()
    report = check.check_shard(problem, positions, out, *grads).as_dict()
    return {**report, "seconds": time.perf_counter() - start}


def step_memory(step, kept=lambda: 0) -> tuple[float, float]:
    """(seconds, bytes) of one call of ``step``: the allocator's peak during it, inputs
    included, plus ``kept()`` bytes held outside the allocator."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return seconds, peak + kept()


def ours(args, mesh, name: str, options: dict):
    """run(s, check) -> {seconds, bytes, kernel[, check]} of one causal fwd+bwd step of
    schedule ``name`` (or of one device when ``mesh`` is None) at global length s, its
    results checked when asked."""
    import schedules
    import sdpa_fusion

    device = mesh.device if mesh is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    sched = schedules.get(name, mesh, **options) if mesh is not None else None
    kernel = args.kernel if device.type == "cuda" else "reference"

    def run(s, check_results=False):
        positions = token_positions(sched, s)
        q, k, v, dout = local_inputs(args, positions, device)
        results = []

        def step():
            out = sdpa_fusion.attention(q, k, v, causal=True, kernel=kernel, schedule=sched)
            results[:] = [out.detach(), torch.autograd.grad(out, (q, k, v), dout)]

        try:
            seconds, used = step_memory(step, lambda: getattr(sched, "kept_bytes", 0))
            plan = sdpa_fusion.plan(q, k, v, causal=True, kernel=kernel, schedule=sched)
            found = dict(seconds=seconds, bytes=used, kernel=plan.kernel.name)
            if check_results:
                found["check"] = checked(args, s, positions, *results)
            return found
        finally:
            del q, k, v, dout, results

    run.described = None if sched is None else lambda s: described_bytes(args, sched, s)
    return run


def token_positions(sched, s: int) -> torch.Tensor:
    """Global positions of this rank's tokens under ``sched`` (every token on one device)."""
    if sched is None:
        return torch.arange(s)
    if not hasattr(sched, "indices"):
        raise ValueError(f"schedule {sched.name!r} does not split the sequence; max_seq "
                         f"measures sequence schedules ({', '.join(SCHEDULES)})")
    return sched.indices(s)


def described_bytes(args, sched, s: int) -> int | None:
    """Bytes per GPU of a step at global length ``s``: the local inputs (q, k, v, dout) and
    what ``describe()`` says the step takes; None when the schedule does not say."""
    from sdpa_fusion import AttentionSpec

    spec = AttentionSpec(1, args.heads, args.heads, s, s, args.head_dim, causal=True,
                         dtype=torch.bfloat16)
    memory = sched.describe(spec).memory
    if memory is None:
        return None
    return 4 * args.heads * (s // sched.size) * args.head_dim * 2 + memory.step


def torch_cp(args, mesh):
    """run(s, check) for PyTorch's context_parallel (alltoall rotation, head-tail load
    balancing, cuDNN attention): full buffers on every rank, sharded in place (rank r keeps
    chunks r and 2P-1-r of 2P, our load-balanced partition)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from schedules.partition import LoadBalanced

    context_parallel, _, set_rotate_method, options = torch_cp_api()
    backend = SDPBackend.CUDNN_ATTENTION if mesh.device.type == "cuda" else SDPBackend.MATH

    def run(s, check_results=False):
        set_rotate_method("alltoall")
        options.enable_load_balance = True
        buffers = [t.detach() for t in local_inputs(args, torch.arange(s), mesh.device)]
        results = []

        def step():
            with sdpa_kernel(backend), context_parallel(
                mesh.torch_mesh, buffers=buffers, buffer_seq_dims=[2] * 4,
                no_restore_buffers=set(buffers),
            ):
                q, k, v = (t.detach().requires_grad_() for t in buffers[:3])
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                results[:] = [out.detach(), torch.autograd.grad(out, (q, k, v), buffers[3])]

        try:
            seconds, used = step_memory(step)
            found = dict(seconds=seconds, bytes=used, kernel=f"torch {backend.name}")
            if check_results:
                positions = LoadBalanced().indices(s, mesh.world_size, mesh.rank)
                found["check"] = checked(args, s, positions, *results)
            return found
        finally:
            del buffers, results

    run.described = None
    return run


# ---- prediction -----------------------------------------------------------------------------
def fit(points) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) ``points``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return my - slope * mx, slope


def predict(points, free: float, multiple: int, described=None) -> int:
    """The longest length, a multiple of ``multiple``, whose predicted memory fits ``free``:
    when ``described`` is given, ``described(s)`` (bytes) mapped by the straight line through
    the probe ``points``' (described, measured) bytes, else the straight line through the
    points themselves."""
    budget = free * HEADROOM
    if described is not None and described(points[0][0]) is not None:
        offset, scale = fit([(described(s), measured) for s, measured in points])
        if scale <= 0:  # nothing measured (CPU ranks)
            return 0

        def fits(s: int) -> bool:
            return offset + scale * described(s) <= budget

        low, high = 0, multiple
        while fits(high):
            high *= 2
        while high - low > multiple:  # the described memory grows with the length
            mid = (low + high) // 2 // multiple * multiple
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low
    intercept, slope = fit(points)
    if slope <= 0:
        return 0
    return int((budget - intercept) / slope) // multiple * multiple


def predicted_seconds(rows, s: int) -> float | None:
    """A step's time at length ``s`` from the longest probe, grown with the square of s."""
    probes = [r for r in rows if r["phase"] == "probe" and r["status"] == "ok"]
    if not probes:
        return None
    longest = max(probes, key=lambda r: r["seq_len"])
    return longest["seconds"] * (s / longest["seq_len"]) ** 2


def free_bytes(mesh) -> float:
    """Memory a step may take on the tightest rank: free device memory plus what torch's
    allocator holds (released first)."""
    if not torch.cuda.is_available():
        return float(8 << 30)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    mine = float(free + torch.cuda.memory_allocated())
    return min(mesh.agree(mine)) if mesh is not None else mine


def measure_impl(args, mesh, impl: str, run, multiple: int) -> list[dict]:
    """Probe rows, then the prediction and (when asked) the confirming steps."""
    rows, points = [], []
    ranks = mesh.world_size if mesh is not None else 1
    for s in args.probe_lens:
        rows.append(attempt(mesh, impl, "probe", s, run, ranks, steps=2))
        if rows[-1]["status"] == "ok":
            points.append((s, rows[-1]["bytes_per_gpu"]))
    free = free_bytes(mesh)
    predicted = None
    if len(points) < 2:
        rows.append(dict(impl=impl, phase="predict", status="error", seq_len=0,
                         error="fewer than two probe steps ran"))
    else:
        intercept, slope = fit(points)
        described = getattr(run, "described", None)
        predicted = predict(points, free, multiple, described)
        rows.append(dict(impl=impl, phase="predict", status="ok", seq_len=predicted,
                         bytes_per_token=slope, intercept_bytes=intercept, free_bytes=free,
                         ranks=ranks,
                         by="describe()" if described else "a line through the probes"))
    if wanted(args, impl):
        rows += confirm(args, mesh, impl, run, multiple, rows, predicted)
    return rows


def confirm(args, mesh, impl, run, multiple: int, rows, predicted) -> list[dict]:
    """The confirming step(s), checked: at each ``--confirm-lens`` length (rounded down to
    ``multiple``), else at 95% of the prediction within ``--confirm-budget-s``."""
    ranks = mesh.world_size if mesh is not None else 1
    if args.confirm_lens:
        return [attempt(mesh, impl, "confirm", s // multiple * multiple, run, ranks,
                        checked=True, asked=True, predicted=predicted, full=False,
                        predicted_seconds=predicted_seconds(rows, s // multiple * multiple))
                for s in args.confirm_lens]
    if not predicted:
        return []
    full = int(predicted * CONFIRM_FRACTION) // multiple * multiple
    target = within_budget(rows, full, args.confirm_budget_s, multiple)
    if target <= max(args.probe_lens):
        return [dict(impl=impl, phase="confirm", status="skipped", seq_len=full, ranks=ranks,
                     error=f"a step longer than the probes is predicted to take more than "
                           f"--confirm-budget-s {args.confirm_budget_s:.0f}")]
    return [attempt(mesh, impl, "confirm", target, run, ranks, checked=True, predicted=predicted,
                    full=target == full, predicted_seconds=predicted_seconds(rows, target))]


def within_budget(rows, target: int, budget_s: float, multiple: int) -> int:
    """``target``, or the longest multiple of ``multiple`` below it whose step the probes
    predict to take at most ``budget_s`` (time grows with the square of the length)."""
    seconds = predicted_seconds(rows, target)
    if seconds is None or seconds <= budget_s:
        return target
    return int(target * (budget_s / seconds) ** 0.5) // multiple * multiple


def attempt(mesh, impl, phase, s, run, ranks, steps: int = 1, checked: bool = False,
            **extra) -> dict:
    """``steps`` steps at global length ``s`` on every rank: a row with the slowest rank's
    time of the last step (the first of a probe pays one-time setup, which would grow with
    the square of the length in a predicted time), the largest memory of any step on any
    rank, the kernel, or the first failure. ``checked``: the last step's results are checked
    on every rank (``check``); a step past the tolerance has status "wrong"."""
    try:
        runs = [run(s, checked and i == steps - 1) for i in range(steps)]
        mine = dict(runs[-1], status="ok", bytes=max(r["bytes"] for r in runs))
    except Exception as e:  # noqa: BLE001 -- an OOM is a result here
        mine = dict(status=common.failure(e).status, error=f"{type(e).__name__}: {e}"[:300])
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    everyone = mesh.agree(mine) if mesh is not None else [mine]
    failed = [m for m in everyone if m["status"] != "ok"]
    row = dict(impl=impl, phase=phase, seq_len=s, ranks=ranks, **extra)
    if failed:
        row.update(status=failed[0]["status"], error=failed[0]["error"])
    else:
        row.update(status="ok", seconds=max(m["seconds"] for m in everyone),
                   bytes_per_gpu=max(m["bytes"] for m in everyone), kernel=mine["kernel"])
        row["gib_per_gpu"] = row["bytes_per_gpu"] / common.GIB
    if checked and not failed:
        row["check"] = check.merge([m["check"] for m in everyone])
        row["check"]["seconds"] = max(m["check"]["seconds"] for m in everyone)
        row["errors"] = row["check"]["errors"]
        if not row["check"]["right"]:
            row.update(status="wrong", error="results past the tolerance on sampled rows: "
                                             + check.line(row["check"]))
    print(f"{impl:>14} {phase:>7} s={common.short(s) if s else s}: "
          + (f"{row['seconds']:.1f} s, {row['gib_per_gpu']:.1f} GiB, {row['kernel']}"
             if not failed else row["status"])
          + (f"; {check.line(row['check'])}" if "check" in row else ""), flush=True)
    return row


def length_multiple(args, ranks: int) -> int:
    """Lengths are multiples of this: two chunks of 1024 tokens per rank (64 with --tiny)."""
    return 2 * ranks * (64 if args.tiny else 1024)


def implementations(args, mesh):
    """(label, run, length multiple) of every implementation to measure over ``mesh``."""
    for impl in args.impls:
        if impl == "torch-cp":
            yield impl, torch_cp(args, mesh), length_multiple(args, mesh.world_size)
            continue
        name, options = impl_options(impl)
        yield impl, ours(args, mesh, name, options), length_multiple(args, mesh.world_size)


# ---- records --------------------------------------------------------------------------------
def summary(rows) -> list[dict]:
    """Per implementation: predicted and confirmed lengths (the longest confirming step that
    ran and was checked right; an unchecked one, from before the check, confirms nothing),
    and the ratio to one GPU's prediction."""
    out = {}
    for r in rows:
        entry = out.setdefault(r["impl"], {"impl": r["impl"], "ranks": r.get("ranks"),
                                           "confirmed": None, "confirmed_full": False,
                                           "confirmed_asked": False})
        if r["phase"] == "predict" and r["status"] == "ok":
            entry["predicted"] = r["seq_len"]
            entry["gib_per_1k_tokens"] = r["bytes_per_token"] * 1024 / common.GIB
        if r["phase"] != "confirm":
            continue
        status = r["status"] if r["status"] != "ok" or "check" in r else "unchecked"
        entry.setdefault("confirms", []).append(
            {"seq_len": r["seq_len"], "status": status,
             **{k: r.get(k) for k in ("kernel", "errors", "seconds")}})
        if status == "ok" and r["seq_len"] > (entry["confirmed"] or 0):
            entry.update(confirmed=r["seq_len"], confirmed_full=bool(r.get("full")),
                         confirmed_asked=bool(r.get("asked")), confirm_seconds=r.get("seconds"),
                         kernel=r.get("kernel"), confirm_errors=r.get("errors"))
        if status == "ok" or entry["confirmed"] is None:
            entry["confirm_status"] = status
    one = next((e.get("predicted") for e in out.values() if e["impl"].startswith("1 GPU")), None)
    for e in out.values():
        e["ratio_to_one_gpu"] = e["predicted"] / one if one and e.get("predicted") else None
        e["confirmed_ratio_to_one_gpu"] = e["confirmed"] / one if one and e.get("confirmed") else None
    return list(out.values())


def save(args, record) -> None:
    record["summary"] = summary(record["rows"])
    plot_rows = [dict(impl=e["impl"], tokens=e.get("predicted"), confirmed=e.get("confirmed"))
                 for e in record["summary"]]
    common.save(args.name, record, args, plot=False)
    draw(args, record, plot_rows)
    for e in record["summary"]:
        bound = (" (short of 95% of the prediction: a lower bound)" if e.get("confirmed")
                 and not e["confirmed_full"] and not e["confirmed_asked"] else "")
        tried = ", ".join(f"{common.short(c['seq_len'])} {c['status']}"
                          for c in e.get("confirms", []))
        print(f"{e['impl']:>14}: predicted {e.get('predicted')}, confirmed {e.get('confirmed')}"
              f"{bound} ({tried or 'not run'}), predicted x{e['ratio_to_one_gpu'] or 0:.2f} "
              f"one GPU, confirmed x{e['confirmed_ratio_to_one_gpu'] or 0:.2f}")


def draw(args, record, rows) -> None:
    """A bar chart of the predicted longest length per implementation, with the length a step
    ran at (confirmed) marked on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["tokens"]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["impl"] for r in rows]
    ax.bar(names, [r["tokens"] / 1024 for r in rows], color="tab:blue", label="predicted")
    ran = [(n, r["confirmed"] / 1024) for n, r in zip(names, rows) if r["confirmed"]]
    if ran:
        ax.scatter([n for n, _ in ran], [t for _, t in ran], marker="_", s=900, color="black",
                   zorder=3, label="a step ran (confirmed)")
        ax.legend(fontsize=8)
    ax.set_ylabel("longest sequence (K tokens)")
    env = record["environment"]
    ax.set_title(f"{record['title']} ({env.get('device', '?')})", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path = args.results_dir / f"{args.name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    common.copy_files([path], args.copy_to)


def merge(args, record) -> None:
    """Put first in ``record`` the rows of the ``--merge`` results, of implementations not
    measured in this run nor in an earlier result of the list."""
    seen = {row["impl"] for row in record["rows"]}
    earlier, merged = [], []
    for name in args.merge:
        path = args.results_dir / f"{name}.json"
        if not path.exists():
            continue
        rows = [row for row in json.loads(path.read_text())["rows"] if row["impl"] not in seen]
        seen |= {row["impl"] for row in rows}
        earlier += rows
        merged.append(name)
    record["rows"] = earlier + record["rows"]
    record["merged"] = merged


def new_record(args, title) -> dict:
    return {"title": title, "environment": common.environment("benchmarks.max_seq"),
            "settings": {"batch": 1, "heads": args.heads, "head_dim": args.head_dim,
                         "dtype": "bf16", "causal": True, "mode": "fwd+bwd",
                         "probe_lens": args.probe_lens, "kernel": args.kernel,
                         "layout": args.layout, "seed": args.seed,
                         "confirm_lens": args.confirm_lens,
                         "confirm_fraction": CONFIRM_FRACTION, "headroom": HEADROOM,
                         "check": f"out, dq, dk, dv on sampled rows against fp32 math "
                                  f"(benchmarks.check), tolerance "
                                  f"{check.TOLERANCE[torch.bfloat16]} (bf16)"},
            "rows": []}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.single_gpu:
        record = new_record(args, "longest sequence, one device")
        record["rows"] = measure_impl(args, None, f"1 GPU {args.kernel}",
                                      ours(args, None, "replicated", {}),
                                      length_multiple(args, 1))
        merge(args, record)  # one GPU on another kernel, and the schedules, stay
        save(args, record)
        return 0
    import sdpa_fusion

    mesh = sdpa_fusion.init_mesh((-1,), ("seq",),
                                 timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        record = new_record(args, f"longest sequence over {mesh.world_size} ranks")
        for impl, run, multiple in implementations(args, mesh):
            record["rows"] += measure_impl(args, mesh, impl, run, multiple)
            dist.barrier()
        if mesh.rank == 0:
            merge(args, record)
            save(args, record)
    finally:
        sdpa_fusion.close_mesh()
    return 0


if __name__ == "__main__":
    common.run(main)
