"""Packed sequences (THD) on one GPU: every way of running a packed batch, and ``auto``.

    python -m benchmarks.thd               # about 2 min on an H200
    python -m benchmarks.thd --tiny        # seconds on a CPU: checks the script itself

Batches (bf16, 32 heads, head dim 128, causal forward+backward):
  a      15 documents of 1K-32K tokens (269K tokens)
  b      2048 documents of 128 tokens (262K tokens)
  mix    2x32K, 4x8K, 8x2K and 1024x128 (240K tokens)

Ways (``--impls``), each ``sdpa_fusion.attention(q, k, v, layout="thd", kernel=...)`` with
``torch.autograd.grad`` for the backward:
  cudnn per-sequence   one cuDNN call per document (kernels.PerSequence("cudnn"))
  flash varlen         one ATen flash varlen call (kernel="flash")
  cudnn varlen         ATen's cuDNN varlen path: listed as unavailable, with the reason
  cudnn padded         one dense cuDNN call on the documents padded to the longest
  cudnn+flash split    long documents one by one through cuDNN, the short ones in one flash
                       varlen call (the split the cost model finds best; none for batch b)
  fa4 varlen           FlashAttention-4's varlen call, when a kernel "fa4" is registered
  fa4 per-sequence     one FlashAttention-4 call per document
  fa4 padded           one dense FlashAttention-4 call on the documents padded to the longest
  auto                 what kernel="auto" picks (kernels/choice.py, by the cost model of
                       kernels/cost.py)

TFLOP/s count the real pairs of every document (``AttentionSpec.flops``: 4*h*s^2*e/2 per
document, x3.5 forward+backward). ``rel_err``: each way's output against the per-sequence
cuDNN one. The goal printed at the end: auto >= 0.95x the best other way on every batch.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks import common

NAME = "thd"
K = 1024
BATCHES = {
    "a": [32 * K] * 6 + [16 * K] * 2 + [8 * K] * 2 + [10 * K, 6 * K, 4 * K, 2 * K, K],
    "b": [128] * 2048,
    "mix": [32 * K] * 2 + [8 * K] * 4 + [2 * K] * 8 + [128] * 1024,
}
TINY_BATCHES = {"a": [64, 32, 48], "b": [8] * 32, "mix": [64, 16] + [4] * 24,
                "c": [40, 56] + [2, 5, 9] * 10}


def _lognormal(g, median, sigma, low, high, total) -> list[int]:
    """Lengths drawn log-normal (``median``, ``sigma``) within [low, high], packed to ``total``."""
    lengths, packed = [], 0
    while packed < total:
        n = int(median * math.exp(sigma * float(torch.randn((), generator=g))))
        lengths.append(min(max(n, low), high, total - packed))
        packed += lengths[-1]
    return lengths


def _drawn() -> None:
    """Batches c (6 documents of 8K-24K and 1,500 of 16-600) and d (log-normal lengths,
    median 600, sigma 1.2, in [16, 64K], packed to 256K tokens), drawn from seed 0."""
    g = torch.Generator().manual_seed(0)
    BATCHES["c"] = (torch.randint(8 * K, 24 * K + 1, (6,), generator=g).tolist()
                    + torch.randint(16, 601, (1500,), generator=g).tolist())
    BATCHES["d"] = _lognormal(g, 600.0, 1.2, 16, 64 * K, 256 * K)
    TINY_BATCHES["d"] = _lognormal(g, 12.0, 1.2, 2, 128, 512)


_drawn()
GPU_IMPLS = ("cudnn per-sequence", "flash varlen", "cudnn varlen", "cudnn padded",
             "cudnn+flash split", "fa4 varlen", "fa4 per-sequence", "fa4 padded", "auto")
TINY_IMPLS = ("reference per-sequence", "reference padded", "reference+reference split", "auto")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="a,b,mix")
    p.add_argument("--impls", default=None, help=f"comma-separated (default: {','.join(GPU_IMPLS)})")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=2.0, help="timed seconds per measurement")
    p.add_argument("--tiny", action="store_true", help="tiny batches on CPU, reference kernel")
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.batches = args.batches.split(",")
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        args.heads, args.head_dim, args.warmup, args.iters, args.budget_s = 2, 16, 1, 2, None
    default = TINY_IMPLS if args.tiny else GPU_IMPLS
    args.impls = args.impls.split(",") if args.impls else list(default)
    return args


def kernel_of(impl: str, spec):
    """The ``kernel=`` argument of ``impl`` for ``spec``; KernelUnavailable/NotImplementedError
    when it has none here."""
    from sdpa_fusion import kernels
    from sdpa_fusion.kernels.aten import CUDNN_VARLEN

    if impl == "auto":
        return "auto"
    name, way = impl.split(" ", 1)
    if way == "split":
        split = kernels.choice.best_split(spec, *name.split("+"))
        if split is None:
            raise kernels.KernelUnavailable("all documents have one length: nothing to split")
        return split
    if impl == "cudnn varlen":
        raise kernels.KernelUnavailable(CUDNN_VARLEN)
    if name not in kernels.names():
        raise NotImplementedError(f"no kernel {name!r} is registered here")
    if way == "varlen":
        if not kernels.packed.has_varlen(kernels.get(name)):
            raise kernels.KernelUnavailable(f"kernel {name!r} has no varlen call of its own")
        return kernels.Varlen(name)
    return {"per-sequence": kernels.PerSequence, "padded": kernels.Padded}[way](name)


def inputs(lengths, args, seed=0):
    total = sum(lengths)
    g = torch.Generator(device=args.device).manual_seed(seed)
    q, k, v, dout = (torch.randn(total, args.heads, args.head_dim, device=args.device,
                                 generator=g).to(args.dtype) for _ in range(4))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return [t.requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))], cu


def run_batch(args, batch: str, lengths: list[int]) -> list[dict]:
    import sdpa_fusion

    (q, k, v, dout), cu = inputs(lengths, args)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=args.device)
    spec = sdpa_fusion.explain(q, k, v, layout="thd", causal=True, cu_seqlens=cu_t).spec
    flops = spec.flops(backward=True)
    fields = dict(batch=batch, documents=len(lengths), tokens=sum(lengths), heads=args.heads,
                  head_dim=args.head_dim, dtype=str(args.dtype), causal=True, mode="fwd+bwd")
    rows, reference = [], None
    for impl in args.impls:
        try:
            kernel = kernel_of(impl, spec)
            plan = sdpa_fusion.explain(q, k, v, layout="thd", causal=True, cu_seqlens=cu_t,
                                       kernel=kernel)

            def attend(q, k, v, kernel=kernel):
                return sdpa_fusion.attention(q, k, v, layout="thd", causal=True, cu_seqlens=cu_t,
                                             kernel=kernel)

            with torch.no_grad():
                out = attend(q, k, v)
        except Exception as e:  # noqa: BLE001 -- recorded as the row's status
            rows.append(common.make_row(batch, impl, sum(lengths) // len(lengths),
                                        common.failure(e), flops, **fields))
            continue
        reference = out if reference is None else reference
        rel_err = common.relative_error(out, reference)
        del out
        m = common.measure(lambda x: torch.autograd.grad(attend(*x[:3]), x[:3], x[3]),
                           [(q, k, v, dout)], warmup=args.warmup, iters=args.iters,
                           budget_s=args.budget_s)
        rows.append(common.make_row(batch, impl, sum(lengths) // len(lengths), m, flops,
                                    chosen=plan.kernel.name, rel_err=rel_err, **fields))
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def auto_over_best(rows) -> list[dict]:
    """Per batch: auto / the best other way (goal >= 0.95)."""
    others = [impl for impl in dict.fromkeys(r["impl"] for r in rows) if impl != "auto"]
    return common.ratios(rows, lambda r: others if r["impl"] == "auto" else None, same=("batch",),
                         entry=lambda r, best, ratio: {
                             "batch": r["batch"], "auto": r["tflops"], "best": best["impl"],
                             "best_tflops": best["tflops"], "auto/best": ratio})


def main(argv=None) -> int:
    args = parse_args(argv)
    batches = TINY_BATCHES if args.tiny else BATCHES
    name = NAME + ("_tiny" if args.tiny else "")
    record = {
        "title": "packed sequences (THD), one GPU, causal fwd+bwd",
        "environment": common.environment("benchmarks.thd"),
        "settings": {"batches": {b: [[n, batches[b].count(n)] for n in dict.fromkeys(batches[b])]
                                 for b in args.batches},
                     "batches_are": "[[document length, how many], ...]", "impls": args.impls,
                     "heads": args.heads, "head_dim": args.head_dim, "dtype": str(args.dtype),
                     "warmup": args.warmup, "max_iters": args.iters,
                     "budget_s_per_measurement": args.budget_s,
                     "flops": "AttentionSpec.flops of the real documents, x3.5 fwd+bwd",
                     "seq_len": "mean document length of the batch"},
        "rows": [],
    }
    start = time.monotonic()
    for batch in args.batches:
        rows = run_batch(args, batch, batches[batch])
        record["rows"] += rows
        cells = ", ".join(f"{r['impl']}=" + (common.number(r["tflops"]) if r["tflops"] else r["status"])
                          for r in rows)
        print(f"[{time.monotonic() - start:6.1f}s] {batch}: {cells}", flush=True)
        common.save(name, record, args, plot=False)
    record["ratios"] = auto_over_best(record["rows"])
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    paths = common.save(name, record, args)
    print("\nTFLOP/s on real tokens (causal fwd+bwd)")
    print(common.format_table(record["rows"], row_keys=("batch",)))
    for r in record["ratios"]:
        print(f"{r['batch']}: auto {common.number(r['auto'])} / best {r['best']} "
              f"{common.number(r['best_tflops'])} = {r['auto/best']:.2f} (goal >= 0.95)")
    print("auto chose: " + ", ".join(f"{r['batch']}: {r.get('chosen')}" for r in record["rows"]
                                     if r["impl"] == "auto"))
    common.print_failures(record["rows"])
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {record['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    common.run(main)
