"""Long sequences on one GPU: one timed step per case, checked (``single_gpu --preset long``).

    python -m benchmarks.single_gpu --preset long            # 512K and 1M, ~8 min on an H200
    python -m benchmarks.single_gpu --preset long --tiny     # the script, on CPU

Results: ``single_gpu_long.json`` and ``.png`` (not ``single_gpu.json``, whose sweep feeds
the kernel table and ``explain``'s cost table).

The problem: b = 1, 32 heads of 128, bf16, causal forward+backward, BSHE by default
(``--layout``). A step at 1M tokens is 3.2e16 FLOP, about a minute, so each implementation
warms up once at a short length (FA4 compiles, cuDNN builds its plans) and then runs ONE
timed step per length, on the same inputs for every implementation. Every step's out, dQ,
dK and dV are checked on sampled rows against fp32 math (``benchmarks.check``): a step past
the tolerance has status "wrong", its time is kept as ``tflops_as_run`` and its ``tflops``
is None (not a speed). Implementations:

  torch-cudnn   F.scaled_dot_product_attention under sdpa_kernel(CUDNN_ATTENTION): ATen's
                cuDNN called directly, the peer (its dQ is wrong past 2^31-element offsets)
  cudnn         sdpa_fusion.attention(kernel="cudnn"): split where cuDNN's limits say; what
                ``auto`` runs when FlashAttention-4 is not installed
  fa4-direct    flash_attn.cute.flash_attn_func on [B, S, H, D] views, backward through its
                autograd (unavailable, with the reason, where flash_attn is not importable)
  fa4, auto     sdpa_fusion.attention(kernel="fa4" | "auto")

The goals, at the longest length (1M): cudnn / torch-cudnn >= 0.9 (the peer's speed as it
ran, wrong or not: it reached 510 TFLOP/s there with its wrong dQ) and fa4 / fa4-direct >=
0.95, ours counted only when right.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from benchmarks import check, common
from benchmarks.single_gpu import DTYPES, attention_fn, spec_of

NAME = "single_gpu_long"
GOALS = (("cudnn", "torch-cudnn", 0.9), ("fa4", "fa4-direct", 0.95))
PEERS = {ours: (peer, goal) for ours, peer, goal in GOALS}
WARM_LEN = 8192  # the warm-up's length (64 with --tiny)
ASSUMED_TFLOPS = 500  # for --dry-run's estimate


def kernel_of(impl: str, inputs, causal: bool, layout: str) -> str:
    """What ran: the kernel ``plan`` chose for our impls, the backend for torch's."""
    if impl == "fa4-direct":
        return "flash_attn.cute.flash_attn_func"
    if impl.startswith("torch-"):
        return f"torch {impl[len('torch-'):]}"
    import sdpa_fusion

    plan = sdpa_fusion.plan(*inputs[:3], causal=causal, layout=layout, kernel=impl)
    return plan.kernel.name


def shape(args) -> tuple[int, int]:
    """(heads, head dim) of the problem: the first of --head-dims."""
    return args.heads_for[args.head_dims[0]], args.head_dims[0]


def inputs_of(args, s: int, seed: int):
    heads, hd = shape(args)
    return common.random_inputs(1, heads, s, hd, dtype=DTYPES[args.dtype], device=args.device,
                                layout=args.layout, seed=seed)


def warm_up(args, impl: str) -> common.Measurement | None:
    """One untimed fwd+bwd step at a short length; a failure (the impl does not run here)."""
    try:
        fn = attention_fn(impl, True, args.layout)
        q, k, v, dout = inputs_of(args, 64 if args.tiny else WARM_LEN, seed=1)
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    except Exception as e:  # noqa: BLE001 -- recorded as every row of this impl
        return common.failure(e)
    return None


def one_step(args, impl: str, inputs, spec) -> dict:
    """A row: one timed fwd+bwd step of ``impl`` on ``inputs``, then its check."""
    kept, report = [], None

    def step(x):
        q, k, v, dout = x
        out = attention_fn(impl, True, args.layout)(q, k, v)
        kept[:] = [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]

    m = common.measure(step, [inputs], warmup=0, iters=1)
    if m.status == "ok":
        try:
            start = time.perf_counter()
            report = check.check(*inputs, *kept, causal=True).as_dict()
            report["seconds"] = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 -- a check that fails is a result too
            m = common.failure(e)
    kept.clear()
    as_run = m.median_ms
    if report is not None and not report["right"]:
        m = dataclasses.replace(m, status="wrong", error=check.line(report))
    flops = spec.flops(backward=True)
    row = common.make_row(panel(args), impl, spec.q_len, m, flops, **fields(args))
    row.update(tflops_as_run=common.tflops(flops, as_run), check=report,
               errors=report["errors"] if report else None)
    if m.status in ("ok", "wrong"):
        row["kernel"] = kernel_of(impl, inputs, True, args.layout)
    return row


def failed_row(args, impl: str, s: int, m: common.Measurement) -> dict:
    return common.make_row(panel(args), impl, s, m, 0.0, **fields(args),
                           tflops_as_run=None, check=None, errors=None)


def panel(args) -> str:
    return f"hd{shape(args)[1]} causal fwd+bwd {args.layout}"


def fields(args) -> dict:
    heads, hd = shape(args)
    return dict(batch=1, heads=heads, head_dim=hd, causal=True, layout=args.layout,
                dtype=args.dtype, mode="fwd+bwd")


# ---- the goals ----------------------------------------------------------------------------
def goal_ratios(rows) -> list[dict]:
    """Per length and goal: ours (right only) over the peer as it ran (right or not)."""
    found = common.ratios(rows, lambda r: PEERS[r["impl"]][0] if r["impl"] in PEERS else None,
                          same=("seq_len",), base_value="tflops_as_run", every=True,
                          entry=goal_entry)
    order = [ours for ours, _, _ in GOALS]
    return sorted(found, key=lambda e: (e["seq_len"], order.index(e["ours"])))


def goal_entry(row, peer, ratio) -> dict:
    goal = PEERS[row["impl"]][1]
    return {"seq_len": row["seq_len"], "ours": row["impl"], "peer": peer["impl"], "goal": goal,
            "ratio": ratio, "met": ratio is not None and ratio >= goal,
            "ours_status": row["status"], "peer_status": peer["status"]}


def verdicts(ratio_rows) -> list[str]:
    """One line per goal, at the longest length measured."""
    if not ratio_rows:
        return ["goals: not measured (needs cudnn and torch-cudnn, fa4 and fa4-direct)"]
    longest = max(r["seq_len"] for r in ratio_rows)
    lines = []
    for r in (r for r in ratio_rows if r["seq_len"] == longest):
        got = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        verdict = "met" if r["met"] else "NOT met"
        lines.append(f"goal {r['ours']}/{r['peer']} >= {r['goal']} at {common.short(longest)}: "
                     f"{verdict} ({got}; {r['ours']} {r['ours_status']}, {r['peer']} "
                     f"{r['peer_status']})")
    return lines


# ---- the run --------------------------------------------------------------------------------
def dry_run(args) -> None:
    total = 0.0
    for s in args.seq_lens:
        flops = spec_of(args, shape(args)[1], shape(args)[0], 1, s, True).flops(backward=True)
        seconds = flops / (ASSUMED_TFLOPS * 1e12)
        total += seconds * len(args.impls)
        print(f"s={common.short(s)}: {flops:.2e} FLOP per step, ~{seconds:.0f} s at "
              f"{ASSUMED_TFLOPS} TFLOP/s, {len(args.impls)} impls")
    print(f"about {total / 60:.1f} min of steps, plus warm-ups (FA4 compiles, ~10 s each) and "
          f"checks (seconds each)")


def run(args) -> int:
    """The preset: warm-ups, then one checked step per length and implementation."""
    if args.dry_run:
        dry_run(args)
        return 0
    name = NAME + args.tag + ("_tiny" if args.tiny else "")
    record = {"title": "long sequences, one GPU, one checked step each",
              "environment": common.environment("benchmarks.single_gpu"),
              "settings": {"seq_lens": args.seq_lens, "heads": shape(args)[0],
                           "head_dim": shape(args)[1], "dtype": args.dtype,
                           "layout": args.layout, "impls": args.impls,
                           "warm_len": 64 if args.tiny else WARM_LEN, "timed_steps": 1,
                           "tolerance": check.TOLERANCE[DTYPES[args.dtype]],
                           "goals": [f"{a}/{b} >= {g}" for a, b, g in GOALS]},
              "rows": merged_rows(args)}
    start = time.monotonic()
    failed = {impl: warm_up(args, impl) for impl in args.impls}
    for s in args.seq_lens:
        spec = spec_of(args, shape(args)[1], shape(args)[0], 1, s, True)
        inputs = inputs_of(args, s, seed=0)
        for impl in args.impls:
            row = (one_step(args, impl, inputs, spec) if failed[impl] is None
                   else failed_row(args, impl, s, failed[impl]))
            record["rows"].append(row)
            print(line(row), flush=True)
            common.save(name, record, args, plot=False)
        del inputs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    record["ratios"] = goal_ratios(record["rows"])
    record["goals"] = verdicts(record["ratios"])
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    paths = common.save(name, record, args)
    print("\nTFLOP/s as run (a wrong step's is no speed)")
    for row in record["rows"]:
        print(line(row))
    for text in record["goals"]:
        print(text)
    common.print_failures(record["rows"])
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {record['elapsed_s']} s")
    return 0


def merged_rows(args) -> list[dict]:
    """The rows of ``--merge`` (a result of this preset) of (implementation, length) pairs this
    run does not measure, each naming the file and commit it comes from: one record of parts
    run apart (the cuDNN half before FlashAttention-4 was installed, or one length later)."""
    if not args.merge:
        return []
    path = args.results_dir / f"{args.merge}.json"
    if not path.exists():
        raise ValueError(f"--merge {args.merge}: no {path}; run that half first")
    merged = json.loads(path.read_text())
    commit = merged.get("environment", {}).get("git_commit")
    return [dict(r, merged_from=path.name, merged_git=r.get("merged_git", commit))
            for r in merged["rows"]
            if r["impl"] not in args.impls or r["seq_len"] not in args.seq_lens]


def line(row) -> str:
    speed = common.number(row["tflops_as_run"])
    what = check.line(row["check"]) if row["check"] else row.get("error") or ""
    return (f"{row['impl']:>12} s={common.short(row['seq_len'])}: {row['status']}, "
            f"{speed} TFLOP/s as run, {row.get('kernel', '-')}; {what}")
