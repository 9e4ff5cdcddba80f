"""Single-GPU attention: our kernels against torch SDPA's backends, forward and forward+backward.

    python -m benchmarks.single_gpu                  # the full sweep, about 4 min on an H200
    python -m benchmarks.single_gpu --dry-run        # print the plan and the FLOPs, run nothing
    python -m benchmarks.single_gpu --tiny           # seconds on a CPU: checks the script itself
    python -m benchmarks.single_gpu --kernel-table-from benchmarks/results/single_gpu.json
                                                     # rewrite the kernel table from a result
    python -m benchmarks.single_gpu --preset long    # 512K and 1M tokens, one checked step
                                                     # each, ~8 min (benchmarks.long_steps)

Implementations (``--impls``):
  auto, cudnn, fa4, flash,     sdpa_fusion.attention(q, k, v, kernel=K)
  nvfuser
  nvfuser-fused                nvFuser's fused forward+backward definition (fwd+bwd only),
                               when the package provides it
  torch-flash, torch-cudnn,    F.scaled_dot_product_attention under
  torch-efficient, torch-math  sdpa_kernel(SDPBackend.<backend>)
  fa4-direct                   FlashAttention-4's flash_attn_func on [B, S, H, D] views,
                               backward through its autograd (unavailable without it)
Above ``--all-impls-up-to`` (32K) only auto, fa4 and cudnn run (the goal's kernels; the
others are slower and would take most of the time).

Shapes: the batch shrinks as the sequence grows so that b*s tokens stay constant
(``--tokens``, default 32K; b = 1 from 32K on), and heads*head_dim stays 2048 (32 heads of
64, 16 of 128, 8 of 256), so every sequence length does the same work per token pair. "fwd"
is the forward of a training step (inputs require grad); "fwd+bwd" adds
``torch.autograd.grad`` of the output. Every implementation's output is compared once with
torch SDPA's (``rel_err``) before it is timed.

The kernel table: after the kernels of one (head dim, causal) group are measured, their mean
forward+backward TFLOP/s over the sequence lengths goes into the table that ``auto`` ranks
kernels by (``sdpa_fusion/kernels/measured_tflops.json``, ``--kernel-table``), and then
``auto`` is measured with it. Goals printed at the end: auto / cudnn >= 1.08 (forward+
backward, hd 128, 8K-128K), auto / best torch backend >= 0.95, nvfuser / torch-flash >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.kernel_table import write_kernel_table
from benchmarks.progress import Progress
from sdpa_fusion.kernels import ranking

NAME = "single_gpu"
OURS = ("auto", "cudnn", "fa4", "flash", "nvfuser", "reference")
TORCH_BACKENDS = {
    "torch-flash": "FLASH_ATTENTION",
    "torch-cudnn": "CUDNN_ATTENTION",
    "torch-efficient": "EFFICIENT_ATTENTION",
    "torch-math": "MATH",
}
GPU_IMPLS = ("auto", "fa4", "cudnn", "flash", "nvfuser", "nvfuser-fused",
             "torch-flash", "torch-cudnn")
KNOWN_IMPLS = (*OURS, "nvfuser-fused", "fa4-direct", *TORCH_BACKENDS)
LONG_IMPLS = ("auto", "fa4", "cudnn")  # the only ones above --all-impls-up-to
TINY_IMPLS = ("auto", "reference", "fa4", "nvfuser", "nvfuser-fused", "torch-math", "torch-flash")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SUSPECT_ERROR = 2e-2  # bf16 attention lands near 1e-3..1e-2 of the reference
PRESETS = {
    "long": {
        "doc": "512K and 1M tokens, b = 1, 32 heads of 128, causal fwd+bwd, BSHE: one warm-up "
               "per impl, one timed step per case, each checked (benchmarks.long_steps)",
        "seq_lens": common.int_list("512k,1m"), "head_dims": [128], "heads": "128:32",
        "causal": "yes", "modes": "fwd+bwd", "layout": "bshe",
        "impls": "torch-cudnn,cudnn,fa4-direct,fa4,auto",
    },
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=common.int_list,
                   default=common.int_list("4k,8k,16k,32k,64k,128k"))
    p.add_argument("--head-dims", type=common.int_list, default=[128, 64, 256],
                   help="in run order: hd 128 (the goal's) first, in case time runs out")
    p.add_argument("--heads", default="64:32,128:16,256:8",
                   help="heads per head dim, 'hd:heads,...' (default: %(default)s)")
    p.add_argument("--tokens", type=common.int_list, default=[32768],
                   help="batch * seq_len (the batch is tokens // seq_len, at least 1)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--impls", default=",".join(GPU_IMPLS))
    p.add_argument("--all-impls-up-to", type=common.int_list, default=[32768],
                   help=f"longer sequences run only {', '.join(LONG_IMPLS)} (default: 32k)")
    p.add_argument("--kernel-table", type=Path, default=None,
                   help="the kernel table to write (default: the one auto reads; with --tiny "
                        "measured_tflops_tiny.json in --results-dir)")
    p.add_argument("--no-kernel-table", action="store_true",
                   help="write no kernel table (auto then ranks by the table as it is)")
    p.add_argument("--kernel-table-from", type=Path, metavar="RESULT_JSON",
                   help="write the kernel table from this saved result and exit")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layout", choices=("bhse", "bshe"), default="bhse")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls first; the first compiles FA4 and nvFuser kernels")
    p.add_argument("--iters", type=int, default=15, help="most timed iterations per measurement")
    p.add_argument("--budget-s", type=float, default=0.5,
                   help="timed seconds per measurement; fewer iterations (>= 3) when slower")
    p.add_argument("--max-seconds", type=float, default=0,
                   help="stop starting new cases after this long (0: no limit)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes and CPU-capable impls, results as single_gpu_tiny.json")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--tag", default="",
                   help="appended to the result name, for an ad-hoc run beside the committed one")
    p.add_argument("--merge", default="",
                   help="--preset long: a result (name in the results folder) whose rows of "
                        "(implementation, length) pairs not run here this record keeps, e.g. "
                        "the cuDNN half run before FlashAttention-4 was installed")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="; ".join(f"{k}: {v['doc']}" for k, v in PRESETS.items()))
    common.add_output_args(p)
    preset = p.parse_known_args(argv)[0].preset
    if preset:
        p.set_defaults(**{k: v for k, v in PRESETS[preset].items() if k != "doc"})
    args = p.parse_args(argv)
    if args.no_kernel_table:
        args.kernel_table = None
    elif args.kernel_table is None:
        args.kernel_table = (args.results_dir / "measured_tflops_tiny.json" if args.tiny
                             else ranking.TABLE)
    if args.tiny and args.preset == "long":
        if args.seq_lens == PRESETS["long"]["seq_lens"]:
            args.seq_lens = [256, 512]
        args.head_dims, args.heads = [16], "16:4"
        if args.impls == PRESETS["long"]["impls"]:
            args.impls = "torch-math,reference,fa4-direct,auto"
    elif args.tiny:
        args.seq_lens, args.head_dims, args.tokens = [64, 128], [16, 32], [256]
        args.heads = "16:4,32:2"
        args.warmup, args.iters, args.budget_s = 1, 3, None
        if args.impls == ",".join(GPU_IMPLS):
            args.impls = ",".join(TINY_IMPLS)
    pairs = (item.split(":") for item in args.heads.split(","))
    args.heads_for = {int(hd): int(heads) for hd, heads in pairs}
    args.impls = args.impls.split(",")
    args.modes = args.modes.split(",")
    args.causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    unknown = [i for i in args.impls if i not in KNOWN_IMPLS]
    if unknown:
        p.error(f"unknown impls {unknown}; choose from {list(KNOWN_IMPLS)}")
    return args


def groups(args):
    """The cases (head_dim, heads, batch, seq_len, causal) in run order, grouped as the
    entries of the kernel table are: one group per head dim and causal flag."""
    for hd in args.head_dims:
        for causal in args.causals:
            yield [(hd, args.heads_for[hd], max(1, args.tokens[0] // s), s, causal)
                   for s in args.seq_lens]


def impls_for(args, s: int, *, auto: bool) -> list[str]:
    """The impls measured at sequence length ``s``: auto alone (it runs after the table of its
    group is written) or all the others; with no table to write, all of them in the first
    pass, auto beside the kernels it picks from (same inputs, same moment)."""
    if args.kernel_table is None:
        chosen = [] if auto else list(args.impls)
    else:
        chosen = [i for i in args.impls if (i == "auto") == auto]
    return chosen if s <= args.all_impls_up_to[0] else [i for i in chosen if i in LONG_IMPLS]


def spec_of(args, hd, heads, batch, s, causal):
    from sdpa_fusion import AttentionSpec

    return AttentionSpec(batch=batch, heads=heads, kv_heads=heads, q_len=s, kv_len=s,
                         head_dim=hd, dtype=DTYPES[args.dtype], causal=causal, layout=args.layout)


# ---- what runs ----------------------------------------------------------------------------
def attention_fn(impl: str, causal: bool, layout: str):
    """(q, k, v) -> out for ``impl``."""
    if impl == "fa4-direct":
        return fa4_direct(causal)
    if impl in TORCH_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, TORCH_BACKENDS[impl])

        def torch_sdpa(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return torch_sdpa
    import sdpa_fusion

    def ours(q, k, v):
        return sdpa_fusion.attention(q, k, v, causal=causal, layout=layout, kernel=impl)

    return ours


def fa4_direct(causal: bool):
    """(q, k, v) -> out of FlashAttention-4 called directly on [B, S, H, D] views."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 -- ImportError, or a CUTLASS DSL that fails to load
        raise ImportError(f"fa4-direct needs FlashAttention-4 (pip install flash-attn-4): "
                          f"flash_attn.cute is not importable here ({type(e).__name__}: "
                          f"{e})") from None

    def fa4(q, k, v):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal=causal)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return fa4


def fused_forward_backward(spec):
    """(q, k, v, dout) -> outputs of nvFuser's fused forward+backward, and how it was found.

    Looks for a ``forward_backward`` method on the nvfuser kernel, then for the
    ``SdpaForwardBackward`` definition (``SdpaForwardBackward(spec).execute([q, k, v, dout])``).
    """
    from sdpa_fusion import kernels

    method = getattr(kernels.get("nvfuser"), "forward_backward", None)
    if method is not None:
        def via_kernel(q, k, v, dout):
            return method(q, k, v, dout, causal=spec.causal, scale=spec.softmax_scale)

        return via_kernel, "kernels.get('nvfuser').forward_backward"
    import sdpa_fusion

    definition = getattr(sdpa_fusion, "SdpaForwardBackward", None)
    if definition is None:
        raise NotImplementedError("sdpa_fusion has no SdpaForwardBackward (nor a fused "
                                  "forward_backward on the nvfuser kernel)")
    fd = definition(spec)
    return (lambda q, k, v, dout: fd.execute([q, k, v, dout])), "SdpaForwardBackward.execute"


def forward_step(fn):
    return lambda x: fn(x[0], x[1], x[2])


def train_step(fn):
    def step(x):
        q, k, v, dout = x
        return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    return step


def check(fn, inputs, ref) -> float | None:
    """Relative error of one forward against torch SDPA's output (None when not comparable)."""
    with torch.no_grad():
        out = fn(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return None
    return common.relative_error(out, ref)


# ---- the sweep ----------------------------------------------------------------------------
def run_case(args, impls, hd, heads, batch, s, causal) -> list[dict]:
    spec = spec_of(args, hd, heads, batch, s, causal)
    device = torch.device(args.device)
    one_set = 4 * batch * heads * s * hd * spec.dtype.itemsize
    sets = [common.random_inputs(batch, heads, s, hd, dtype=spec.dtype, device=device,
                                 layout=args.layout, seed=i)
            for i in range(common.rotation_count(one_set, device))]
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(*sets[0][:3], is_causal=causal)
    fields = dict(batch=batch, heads=heads, head_dim=hd, causal=causal, layout=args.layout,
                  dtype=args.dtype)
    rows = []
    for impl in impls:
        checked = {}
        for mode in args.modes:
            if impl == "nvfuser-fused" and mode == "fwd":
                continue
            m, rel_err, via = run_one(args, impl, mode, spec, sets, ref, checked)
            row = common.make_row(f"hd{hd} {'causal' if causal else 'full'} {mode}", impl, s, m,
                                  spec.flops(backward=mode == "fwd+bwd"), mode=mode, **fields)
            row.update(rel_err=rel_err, suspect=rel_err is not None and not rel_err < SUSPECT_ERROR)
            if via:
                row["via"] = via
            rows.append(row)
    del sets, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_one(args, impl, mode, spec, sets, ref, checked: dict):
    """(Measurement, rel_err, how the fused path was found) of one impl in one mode; the
    output check runs once per impl (``checked`` keeps its result)."""
    via = None
    try:
        if impl == "nvfuser-fused":
            fused, via = fused_forward_backward(spec)
            step = lambda x: fused(*(t.detach() for t in x))  # noqa: E731
            fn = lambda q, k, v: fused(q, k, v, sets[0][3])  # noqa: E731
        else:
            fn = attention_fn(impl, spec.causal, args.layout)
            step = forward_step(fn) if mode == "fwd" else train_step(fn)
        if "rel_err" not in checked:
            checked["rel_err"] = check(fn, sets[0][:3], ref)
        rel_err = checked["rel_err"]
    except Exception as e:  # noqa: BLE001 -- recorded as the row's status
        return common.failure(e), None, via
    m = common.measure(step, sets, warmup=args.warmup, iters=args.iters, budget_s=args.budget_s)
    return m, rel_err, via


RATIOS = (("auto", "cudnn"), ("fa4", "cudnn"), ("nvfuser", "torch-flash"),
          ("nvfuser-fused", "torch-flash"), ("auto", "torch-best"))  # torch-best: the fastest


def ratio_table(rows) -> list[dict]:
    """Per case and size: the fastest torch backend's TFLOP/s (``torch_best``) and ours over
    theirs (``RATIOS``): the goal auto / cudnn >= 1.08 at hd 128, 8K-128K, fwd+bwd; fa4 /
    cudnn; auto / the fastest torch backend and nvfuser / torch-flash >= 0.95."""
    table = {}
    for r in rows:
        if r["tflops"] is not None:
            entry = table.setdefault((r["panel"], r["seq_len"]), {
                "panel": r["panel"], "seq_len": r["seq_len"], "torch_best": None})
            if r["impl"].startswith("torch-"):
                entry["torch_best"] = max(entry["torch_best"] or 0.0, r["tflops"])
    backends = [i for i in dict.fromkeys(r["impl"] for r in rows) if i.startswith("torch-")]
    for ours, peer in RATIOS:
        peers = backends if peer == "torch-best" else peer
        for e in common.ratios(rows, lambda r, ours=ours, peers=peers:
                               peers if r["impl"] == ours else None):
            table[e["panel"], e["seq_len"]][f"{ours}/{peer}"] = e["ratio"]
    return list(table.values())


RATIO_KEYS = ("auto/cudnn", "fa4/cudnn", "auto/torch-best", "nvfuser/torch-flash",
              "nvfuser-fused/torch-flash")


def goal(ratio_rows) -> str:
    """The goal's verdict: auto / cudnn, forward+backward, hd 128, 8K-128K."""
    hits = [(r["panel"], r["seq_len"], r["auto/cudnn"]) for r in ratio_rows
            if r["panel"].startswith("hd128 ") and r["panel"].endswith("fwd+bwd")
            and r["seq_len"] >= 8192 and "auto/cudnn" in r]
    if not hits:
        return "goal auto/cudnn >= 1.08 (hd 128, 8K-128K, fwd+bwd): not measured"
    panel, s, worst = min(hits, key=lambda h: h[2])
    verdict = "met" if worst >= 1.08 else "NOT met"
    return (f"goal auto/cudnn >= 1.08 (hd 128, 8K-128K, fwd+bwd): {verdict}; lowest "
            f"{worst:.2f} ({panel}, s={common.short(s)}) over {len(hits)} cases")


def print_summary(rows, ratio_rows) -> None:
    print("\nTFLOP/s (per GPU)")
    print(common.format_table(rows, row_keys=("panel", "seq_len")))
    if ratio_rows:
        print("\nratios (goals: auto/cudnn >= 1.08 at hd 128 from 8K; the others >= 0.95)")
        table = [{"panel": r["panel"], "seq_len": r["seq_len"], "impl": k, "ratio": r[k],
                  "status": "ok"} for r in ratio_rows for k in RATIO_KEYS if k in r]
        if table:
            print(common.format_table(table, row_keys=("panel", "seq_len"), value="ratio",
                                      fmt="{:.2f}"))
        print(goal(ratio_rows))
    suspects = [r for r in rows if r.get("suspect")]
    for r in suspects:
        print(f"SUSPECT: {r['impl']} {r['panel']} s={r['seq_len']}: rel_err={r['rel_err']}")


def dry_run(args) -> None:
    total = 0.0
    for group in groups(args):
        for hd, heads, batch, s, causal in group:
            spec = spec_of(args, hd, heads, batch, s, causal)
            impls = len(impls_for(args, s, auto=False)) + len(impls_for(args, s, auto=True))
            f = sum(spec.flops(backward=m == "fwd+bwd") for m in args.modes)
            total += f * impls
            print(f"hd={hd} heads={heads} batch={batch} s={common.short(s)} causal={causal}: "
                  f"{f / 1e12:.1f} TFLOP per impl per iteration, {impls} impls")
    iters = args.warmup + 4
    print(f"modes {args.modes}: {total / 1e12:.0f} TFLOP per iteration of every impl; at 500 "
          f"TFLOP/s and {iters} iterations about {total * iters / 500e12:.0f} s of compute")


def case_count(args) -> int:
    """Cases the sweep measures (one line of progress each)."""
    return sum(1 for group in groups(args) for auto in (False, True) for case in group
               if impls_for(args, case[3], auto=auto))


def measure_group(args, record, group, deadline, progress) -> None:
    """The kernels of one (head dim, causal) group at every length, then the kernel table,
    then auto (which ranks the kernels by that table)."""
    for auto in (False, True):
        for hd, heads, batch, s, causal in group:
            label = f"hd={hd} h={heads} b={batch} s={common.short(s)} causal={causal}"
            impls = impls_for(args, s, auto=auto)
            if not impls:
                continue
            if deadline.left() <= 0:
                print(progress.step(f"skipped (time budget): {label} {','.join(impls)}"),
                      flush=True)
                continue
            rows = run_case(args, impls, hd, heads, batch, s, causal)
            record["rows"] += rows
            cells = ", ".join(f"{r['impl']}:{r['mode']}="
                              + (common.number(r["tflops"]) if r["tflops"] is not None
                                 else r["status"]) for r in rows)
            print(progress.step(f"{label}: {cells}"), flush=True)
        if not auto and args.kernel_table is not None:
            write_kernel_table(record, args.kernel_table)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.kernel_table_from:
        table = args.kernel_table or ranking.TABLE
        path = write_kernel_table(json.loads(args.kernel_table_from.read_text()), table)
        print(f"wrote {path} from {args.kernel_table_from}")
        return 0
    if args.preset == "long":
        from benchmarks import long_steps

        return long_steps.run(args)
    if args.dry_run:
        dry_run(args)
        return 0
    name = NAME + args.tag + ("_tiny" if args.tiny else "")
    record = {
        "title": "single GPU attention",
        "environment": common.environment("benchmarks.single_gpu"),
        "settings": {
            "seq_lens": args.seq_lens, "head_dims": args.head_dims, "heads_for_head_dim":
            args.heads_for, "tokens_per_batch": args.tokens[0], "dtype": args.dtype,
            "layout": args.layout, "impls": args.impls, "modes": args.modes,
            "long_impls": [i for i in args.impls if i in LONG_IMPLS],
            "all_impls_up_to": args.all_impls_up_to[0],
            "warmup": args.warmup, "max_iters": args.iters,
            "budget_s_per_measurement": args.budget_s,
            "shape_rule": "batch = tokens // seq_len; heads*head_dim = 2048 by default",
            "fwd": "forward of a training step (q, k, v require grad)",
            "fwd+bwd": "forward then torch.autograd.grad(out, (q, k, v), dout)",
            "flops": "AttentionSpec.flops: 4*b*h*s^2*e (x0.5 causal), x3.5 for fwd+bwd",
            "auto": ("measured after the kernel table of its (head dim, causal) group was "
                     "written from this run's kernels" if args.kernel_table is not None else
                     "measured beside the other kernels, ranking them by the committed table"),
        },
        "rows": [],
    }
    deadline = common.Deadline(args.max_seconds)
    start = time.monotonic()
    progress = Progress(case_count(args))
    for group in groups(args):
        measure_group(args, record, group, deadline, progress)
        common.save(name, record, args, plot=False)
    record["ratios"] = ratio_table(record["rows"])
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    paths = common.save(name, record, args, metrics=("tflops",))
    if args.kernel_table is not None:
        paths.append(args.kernel_table)
        common.copy_files([args.kernel_table], args.copy_to)
    print_summary(record["rows"], record["ratios"])
    common.print_failures(record["rows"])
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {record['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    common.run(main)
