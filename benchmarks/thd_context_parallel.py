"""Packed sequences (THD) and sliding windows under the sequence schedules, against one GPU.

    mpirun -np 2 python -m benchmarks.thd_context_parallel                  # ~3 min, 2 H200
    mpirun -np 2 --oversubscribe python -m benchmarks.thd_context_parallel --tiny   # CPU ranks

Packed batches (``benchmarks.thd``'s; bf16, 32 heads, head dim 128, causal fwd+bwd):
  a   15 documents of 1K-32K tokens (269K tokens)
  b   2048 documents of 128 tokens
  c   6 documents of 8K-24K and 1,500 of 16-600 tokens
  d   log-normal lengths (median 600, sigma 1.2) in [16, 64K], packed to 256K tokens
rows: "1 GPU <kernel>" (rank 0 runs the whole batch alone while the other ranks wait),
"ring", "allgather", "ulysses" (``schedules.get(name, mesh)``, their default partition,
``kernel=``); ``--schedules`` entries take options, e.g. ``ulysses:transport=p2p`` or
``ring:partition=documents,ring:partition=load_balanced`` (the row is named by the entry).
TFLOP/s per GPU count the real documents' pairs (``AttentionSpec.flops``) / ranks / the
slowest rank's median time. Goal: every schedule >= 0.85x one GPU per GPU on batch a.

Sliding window: one sequence of 128K tokens (b = 1, 32 heads, head dim 128, bf16, causal
fwd+bwd) under ``ring``, full causal vs a window of 4K keys back (``window=(4096, 0)``), each
``--window-kernels`` entry, and the same on one GPU. The window's speed-up over full causal
divided by what its FLOP count allows (t_full / t_window) / (flops_full / flops_window) is
its efficiency; goal >= 0.8 under ring.

Whole documents to ranks (``--preset documents``; ``thd_context_parallel_documents.json``):
batches a-d under ``ring`` with partition ``documents`` and with ``load_balanced`` (every
document cut into 2P chunks), and under ``ulysses`` with ``documents`` (and
``keep_forward=True``), no window. Goals: per
GPU at least 0.9x one GPU on every batch (either ``documents``), and the ring's
``documents`` at least 3x its ``load_balanced`` on batch b.

Outputs are checked against one device (``rel_err``), and each rank's out and gradients of
the packed batches on sampled rows against fp32 math (``check``; a wrong one is no figure:
its status says so). JSON and PNG go to benchmarks/results/
(``thd_context_parallel.json``); ``--tiny`` runs small problems with the reference kernel.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist

from benchmarks import check, common
from benchmarks.context_parallel import impl_options
from benchmarks.thd import BATCHES, TINY_BATCHES

NAME = "thd_context_parallel"
SCHEDULES = ("ring", "allgather", "ulysses")
DOCUMENTS, LOAD_BALANCED = "ring:partition=documents", "ring:partition=load_balanced"
# cut documents split by heads instead, the backward reusing the heads its forward gathered
ULYSSES_DOCUMENTS = "ulysses:partition=documents:keep_forward=True"
PRESETS = {"documents": dict(batches="a,b,c,d",
                             schedules=f"{DOCUMENTS},{LOAD_BALANCED},{ULYSSES_DOCUMENTS}",
                             window=False)}
PER_GPU_GOAL = {None: 0.85, "documents": 0.9}  # per-GPU TFLOP/s over one GPU's, per preset
SPLIT_GOAL = 3.0  # documents over load_balanced on batch b (--preset documents)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="a,b")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--kernel", default="auto", help="local kernel of the packed batches")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window-seq", type=common.int_list, default=common.int_list("128k"))
    p.add_argument("--window", type=int, default=4096, help="keys back of the sliding window")
    p.add_argument("--window-kernels", default="auto,flash")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tag", default="",
                   help="appended to the result name, for an ad-hoc run beside the committed one")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="documents: batches a-d, whole documents against every document cut "
                        "(ring), no window; its own result name")
    common.add_distributed_args(p)
    args = p.parse_args(argv)
    args.window_part = True
    if args.preset:
        preset = PRESETS[args.preset]
        args.batches, args.schedules = preset["batches"], preset["schedules"]
        args.window_part = preset["window"]
    args.batches = [b for b in args.batches.split(",") if b]
    args.schedules = [s for s in args.schedules.split(",") if s]
    args.window_kernels = [k for k in args.window_kernels.split(",") if k]
    args.window_seq = args.window_seq[0]
    args.dtype = torch.bfloat16
    if args.tiny:
        args.heads, args.head_dim, args.dtype = 8, 16, torch.float32
        args.window_seq, args.window, args.warmup, args.iters = 256, 8, 1, 2
        args.kernel, args.window_kernels = "reference", ["reference"]
    args.name = NAME + (f"_{args.preset}" if args.preset else "") + args.tag + \
        ("_tiny" if args.tiny else "")
    return args


def spec_of(args, length: int, cu=None, window=None):
    """The global problem: one sequence of ``length`` tokens, or packed ones (``cu``)."""
    from sdpa_fusion import AttentionSpec

    layout = "thd" if cu is not None else "bshe"
    return AttentionSpec(batch=1, heads=args.heads, kv_heads=args.heads, q_len=length,
                         kv_len=length, head_dim=args.head_dim, dtype=args.dtype, causal=True,
                         layout=layout, cu_seqlens=None if cu is None else tuple(cu),
                         window=window)


def train(attend, inputs):
    """(step, leaves): one fwd+bwd of ``attend`` on fresh leaves of ``inputs`` (q, k, v, dout)."""
    q, k, v = (t.detach().requires_grad_() for t in inputs[:3])
    leaves = (q, k, v, inputs[3])

    def step(x):
        return torch.autograd.grad(attend(*x[:3]), x[:3], x[3])

    return step, leaves


def timed(args, mesh, step, leaves, *, alone: bool = False) -> common.Measurement:
    """The slowest rank's measurement of ``step`` (``alone``: rank 0's, the others wait)."""
    if alone:
        m = None
        if mesh.rank == 0:
            m = common.measure(step, [leaves], warmup=args.warmup, iters=args.iters)
        return mesh.agree(m)[0]
    m = common.measure(step, [leaves], warmup=args.warmup, iters=args.iters,
                       before_timing=dist.barrier)
    return common.combine_ranks(mesh.agree(m))


def error_against(out: torch.Tensor, ref: torch.Tensor | None) -> float | None:
    return None if ref is None else common.relative_error(out, ref)


def checked(mesh, problem, index, attend, inputs) -> dict:
    """Every rank's out and gradients of one more step of ``attend`` on its ``inputs`` (q, k,
    v, dout; local row i is global token ``index[i]``), on sampled rows against fp32 math
    (``check.merge`` of the ranks' reports: the same on every rank)."""
    q, k, v = (t.detach().requires_grad_() for t in inputs[:3])
    out = attend(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), inputs[3])
    report = check.check_packed_rank(problem, index, out.detach(), *grads)
    return check.merge(mesh.agree(report))


# ---- packed batches -------------------------------------------------------------------------
def packed_inputs(args, lengths, device):
    g = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(sum(lengths), args.heads, args.head_dim, device=device, generator=g)
               .to(args.dtype) for _ in range(4)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    return tensors, cu


def batch_rows(args, mesh, batch: str) -> list[dict]:
    import schedules
    import sdpa_fusion

    lengths = (TINY_BATCHES if args.tiny else BATCHES)[batch]
    inputs, cu = packed_inputs(args, lengths, mesh.device)
    spec = spec_of(args, sum(lengths), cu.tolist())
    flops = spec.flops(backward=True)
    fields = dict(batch=batch, documents=len(lengths), tokens=sum(lengths), mode="fwd+bwd",
                  heads=args.heads, head_dim=args.head_dim, dtype=str(args.dtype))
    panel, mean = f"batch {batch} ({len(lengths)} documents)", sum(lengths) // len(lengths)

    def attend(q, k, v, **kw):
        return sdpa_fusion.attention(q, k, v, layout="thd", causal=True, kernel=args.kernel, **kw)

    with torch.no_grad():
        ref = attend(*inputs[:3], cu_seqlens=cu)
    problem = check.packed_problem(*inputs, cu.tolist(), causal=True)

    def attend_whole(q, k, v):
        return attend(q, k, v, cu_seqlens=cu)

    m = timed(args, mesh, *train(attend_whole, inputs), alone=True)
    checks = checked(mesh, problem, torch.arange(len(inputs[0]), device=cu.device),
                     attend_whole, inputs)
    rows = [common.make_row(panel, f"1 GPU {args.kernel}", mean, check.judged(m, checks), flops,
                            ranks=1, check=check.line(checks), **fields)]
    for entry in args.schedules:
        try:
            name, options = impl_options(entry)
            sched = schedules.get(name, mesh, **options)
            kw = dict(layout="thd", cu_seqlens=cu)
            local = [sched.shard(t, **kw) for t in inputs]

            def attend_local(q, k, v, sched=sched):
                return attend(q, k, v, cu_seqlens=cu, schedule=sched)

            with torch.no_grad():
                rel_err = error_against(sched.unshard(attend_local(*local[:3]), **kw), ref)
            checks = checked(mesh, problem, sched.pack(cu).token_index, attend_local, local)
            m = check.judged(timed(args, mesh, *train(attend_local, local)), checks)
            extra = dict(rel_err=rel_err, steps=sched.describe(spec).steps,
                         check=check.line(checks))
        except Exception as e:  # noqa: BLE001 -- the same on every rank: recorded
            m, extra = common.failure(e), {}
        rows.append(common.make_row(panel, entry, mean, m, flops / mesh.world_size,
                                    ranks=mesh.world_size, **fields, **extra))
    return rows


# ---- sliding window -------------------------------------------------------------------------
def window_rows(args, mesh) -> list[dict]:
    import schedules
    import sdpa_fusion

    s, p = args.window_seq, mesh.world_size
    g = torch.Generator(device=mesh.device).manual_seed(0)
    inputs = [torch.randn(1, s, args.heads, args.head_dim, device=mesh.device, generator=g)
              .to(args.dtype).transpose(1, 2) for _ in range(4)]
    sched = schedules.get("ring", mesh)
    local = [sched.shard(t, layout="bshe") for t in inputs]
    fields = dict(mode="fwd+bwd", heads=args.heads, head_dim=args.head_dim, dtype=str(args.dtype),
                  window_left=args.window)
    panel, rows = f"window {common.short(args.window)} at {common.short(s)}", []
    for kernel in args.window_kernels:
        for window in (None, (args.window, 0)):
            what = "full causal" if window is None else f"window {common.short(args.window)}"
            case = dict(fields, kernel=kernel, mask=what)
            flops = spec_of(args, s, window=window).flops(backward=True)

            def attend(q, k, v, kernel=kernel, window=window, **kw):
                return sdpa_fusion.attention(q, k, v, layout="bshe", causal=True, kernel=kernel,
                                             window=window, **kw)

            try:
                with torch.no_grad():
                    ref = attend(*inputs[:3])
                m = timed(args, mesh, *train(attend, inputs), alone=True)
            except Exception as e:  # noqa: BLE001 -- recorded
                ref, m = None, common.failure(e)
            rows.append(common.make_row(panel, f"1 GPU {what} {kernel}", s, m, flops, ranks=1,
                                        **case))

            def attend_ring(q, k, v, attend=attend):
                return attend(q, k, v, schedule=sched)

            try:
                with torch.no_grad():
                    rel_err = error_against(sched.unshard(attend_ring(*local[:3]), layout="bshe"),
                                            ref)
                m = timed(args, mesh, *train(attend_ring, local))
                steps = sched.describe(spec_of(args, s, window=window)).steps
                extra = dict(rel_err=rel_err, steps=steps)
            except Exception as e:  # noqa: BLE001 -- recorded
                m, extra = common.failure(e), {}
            rows.append(common.make_row(panel, f"ring {what} {kernel}", s, m, flops / p, ranks=p,
                                        **case, **extra))
            del ref
    return rows


# ---- results --------------------------------------------------------------------------------
def goal_ratios(rows, preset: str | None = None) -> list[dict]:
    """Per batch: each schedule's per-GPU TFLOP/s over one GPU's (goal >= 0.85 on a; with
    ``preset="documents"`` >= 0.9 on every batch for ``documents``, and ``documents`` over
    ``load_balanced``, >= 3 on b). Per kernel, on one GPU and under ring: the window's speed-up
    over full causal / the speed-up its FLOPs allow (goal >= 0.8 under ring)."""
    one_gpu = [r["impl"] for r in rows if "batch" in r and r["ranks"] == 1]
    full = [r["impl"] for r in rows if r.get("mask") == "full causal"]

    def per_gpu(r, _, ratio):
        goal = PER_GPU_GOAL[preset]
        if preset == "documents" and r["impl"] not in (DOCUMENTS, ULYSSES_DOCUMENTS):
            goal = None
        return {"case": f"batch {r['batch']}", "impl": r["impl"], "ratio": ratio, "goal": goal}

    batches = common.ratios(
        rows, lambda r: one_gpu if "batch" in r and r["ranks"] > 1 else None, same=("batch",),
        entry=per_gpu)
    split = common.ratios(
        rows, lambda r: LOAD_BALANCED if r["impl"] == DOCUMENTS else None, same=("batch",),
        entry=lambda r, _, ratio: {"case": f"batch {r['batch']}",
                                   "impl": f"{DOCUMENTS} / {LOAD_BALANCED}", "ratio": ratio,
                                   "goal": SPLIT_GOAL if r["batch"] == "b" else None})
    windows = common.ratios(
        rows, lambda r: full if r.get("mask", "full causal") != "full causal" else None,
        same=("kernel", "ranks"), value="median_ms", entry=window_efficiency)
    return batches + split + windows


def window_efficiency(row, full, _) -> dict:
    """A window's speed-up over the full causal step of its kernel and ranks, over the one
    its FLOPs allow."""
    allowed = (full["tflops"] * full["median_ms"]) / (row["tflops"] * row["median_ms"])
    speed_up = full["median_ms"] / row["median_ms"]
    return {"case": row["panel"], "impl": row["impl"], "speed_up": speed_up, "allowed": allowed,
            "ratio": speed_up / allowed, "goal": 0.8 if row["ranks"] > 1 else None}


def main(argv=None) -> int:
    import sdpa_fusion

    args = parse_args(argv)
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",),
                                 timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        record = {"title": f"packed sequences and sliding windows over {mesh.world_size} ranks",
                  "environment": common.environment("benchmarks.thd_context_parallel"),
                  "settings": {k: str(v) if isinstance(v, torch.dtype) else v
                               for k, v in vars(args).items() if k not in ("results_dir",)},
                  "rows": []}
        start, deadline = time.monotonic(), common.Deadline(args.max_seconds)
        for part in [*args.batches, *(["window"] if args.window_part else [])]:
            if not mesh.agree(deadline.left() > 0)[0]:  # every rank stops alike
                continue
            record["rows"] += window_rows(args, mesh) if part == "window" else \
                batch_rows(args, mesh, part)
            report(mesh, record, args, start, part)
        if mesh.rank == 0:
            finish(args, record, start)
    finally:
        sdpa_fusion.close_mesh()
    return 0


def report(mesh, record, args, start, what) -> None:
    if mesh.rank != 0:
        return
    cells = ", ".join(f"{r['impl']}=" + (common.number(r["tflops"]) if r["tflops"]
                                         else r["status"])
                      for r in record["rows"] if r.get("batch", "window") == what)
    print(f"[{time.monotonic() - start:6.1f}s] {what}: {cells}", flush=True)
    common.save(args.name, record, args, plot=False)


def finish(args, record, start) -> None:
    record["ratios"] = goal_ratios(record["rows"], args.preset)
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    paths = common.save(args.name, record, args, metrics=("tflops", "peak_gib"), bars=True)
    print("\nTFLOP/s per GPU (real tokens; a window's own FLOPs)")
    print(common.format_table(record["rows"], row_keys=("panel",)))
    for r in record["ratios"]:
        goal = f" (goal >= {r['goal']})" if r["goal"] else ""
        detail = (f": speed-up {r['speed_up']:.2f} of {r['allowed']:.2f} allowed"
                  if "allowed" in r else "" if " / " in r["impl"] else " per GPU vs one GPU")
        print(f"{r['case']}, {r['impl']}{detail} = {r['ratio']:.2f}{goal}")
    bad = [r for r in record["rows"] if r.get("rel_err") is not None and not r["rel_err"] < 2e-2]
    for r in bad:
        print(f"SUSPECT: {r['impl']} {r['panel']}: rel_err={r['rel_err']:.3g}")
    common.print_failures(record["rows"])
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {record['elapsed_s']} s")


if __name__ == "__main__":
    common.run(main)
