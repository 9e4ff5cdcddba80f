"""FlashAttention-4's backward on one Hopper GPU: its own entry point against ours
(``sdpa_fusion.kernels.fa4_rows.QueryRows``: FA4's kernels, 80-row tiles, one dQ accumulator
for the calls on a set of query rows).

    python -m benchmarks.fa4_backward          # one H200: about a minute

Cases (b = 1, heads of 128, bf16, the same out, lse and dout for both):
- ``causal s, h heads``: one causal backward of s rows. FA4 runs causal calls in 64-row
  tiles, its non-causal ones in 80-row tiles; ``fa4_rows`` runs both in 80-row tiles.
- ``full 16K``: one non-causal backward (both in 80-row tiles: the same kernel).
- ``ring row s``: what a ring of two GPUs does with one rank's rows of a sequence of 2s, on
  one of its two head groups (16 of 32 heads): a causal square call on its s rows, then a
  full call of them against s/2 keys of the other rank. FA4: two entry-point calls (each
  with its own preprocess, dQ accumulator and conversion) and a dQ add; ours: one
  preprocess, one accumulator, one conversion.

Rounds alternate the two implementations (``--rounds``) so that both meet the same clocks;
the JSON keeps every round, the summary the median per case. On a machine without FA4 on
Hopper every row says why it did not run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks import common

NAME = "fa4_backward"
IMPLS = ("FA4 entry point", "fa4_rows (ours)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=common.int_list, default=common.int_list("4k,8k,16k,32k,64k"))
    p.add_argument("--ring-rows", type=common.int_list, default=common.int_list("8k,16k,64k"),
                   help="rows of one rank in the 'ring row' cases")
    p.add_argument("--heads", type=common.int_list, default=[32, 16],
                   help="head counts of the causal cases")
    p.add_argument("--ring-heads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=8)
    common.add_output_args(p)
    return p.parse_args(argv)


def unavailable() -> str | None:
    """Why the comparison cannot run here, or None."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "needs a Hopper (sm90) GPU: fa4_rows runs FA4's sm90 backward"
    from sdpa_fusion.kernels.fa4 import import_error

    return import_error()


def inputs(s_q: int, s_k: int, heads: int, causal: bool, scale: float):
    """(q, k, v, dout, out, lse), logical [B, H, S, E] views of BSHE memory."""
    from sdpa_fusion.kernels import get

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(s):
        return torch.randn(1, s, heads, 128, device="cuda", dtype=torch.bfloat16,
                           generator=g).transpose(1, 2)

    q, dout, k, v = rand(s_q), rand(s_q), rand(s_k), rand(s_k)
    out, lse = get("fa4").forward(q, k, v, causal=causal, scale=scale)
    return q, k, v, dout, out, lse


def entry_point(dout, q, k, v, out, lse, *, causal, scale):
    """(dq, dk, dv) of one call through FA4's ``_flash_attn_bwd``."""
    from sdpa_fusion.kernels.fa4 import _bshd, interface

    return interface()._flash_attn_bwd(*(_bshd(t) for t in (q, k, v, out, dout)), lse,
                                       softmax_scale=scale, causal=causal)


def steps(case: str, s: int, heads: int, scale: float):
    """(FA4's step, our step, inputs, backward FLOPs) of one case."""
    from sdpa_fusion.kernels import fa4_rows

    if case == "ring row":
        q, k, v, dout, out, lse = inputs(s, s, heads, True, scale)
        k2, v2 = k[:, :, : s // 2], v[:, :, : s // 2]

        def fa4(_):
            dq, dk, dv = entry_point(dout, q, k, v, out, lse, causal=True, scale=scale)
            dq2, dk2, dv2 = entry_point(dout, q, k2, v2, out, lse, causal=False, scale=scale)
            dq.add_(dq2)

        def ours(_):
            rows = fa4_rows.QueryRows(dout, out, lse, scale=scale)
            rows.call(slice(None), q, k, v, torch.empty_like(k), torch.empty_like(v), causal=True)
            rows.call(slice(None), q, k2, v2, torch.empty_like(k2), torch.empty_like(v2),
                      causal=False)
            rows.finish(torch.empty_like(q))

        pairs = s * s / 2 + s * s / 2
    else:
        causal = case == "causal"
        q, k, v, dout, out, lse = inputs(s, s, heads, causal, scale)

        def fa4(_):
            entry_point(dout, q, k, v, out, lse, causal=causal, scale=scale)

        def ours(_):
            rows = fa4_rows.QueryRows(dout, out, lse, scale=scale)
            rows.call(slice(None), q, k, v, torch.empty_like(k), torch.empty_like(v),
                      causal=causal)
            rows.finish(torch.empty_like(q))

        pairs = s * s / 2 if causal else s * s
    return fa4, ours, 2.5 * 4 * heads * 128 * pairs  # backward: 2.5x the forward's FLOPs


def cases(args):
    """(case, rows, heads) of every measurement."""
    return ([("causal", s, h) for h in args.heads for s in args.seq_lens]
            + [("full", 16384, args.heads[0])]
            + [("ring row", s, args.ring_heads) for s in args.ring_rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    record = {"title": "FA4 backward: its entry point vs fa4_rows (one GPU)",
              "environment": common.environment("benchmarks.fa4_backward"),
              "settings": {"seq_lens": args.seq_lens, "ring_rows": args.ring_rows,
                           "heads": args.heads, "ring_heads": args.ring_heads,
                           "head_dim": 128, "dtype": "bf16",
                           "rounds": args.rounds, "iters": args.iters},
              "rows": []}
    reason = unavailable()
    for case, s, heads in cases(args):
        panel = f"{case} {common.short(s)}, {heads} heads"
        if reason is not None:
            m = common.Measurement(status="unavailable", error=reason)
            record["rows"] += [common.make_row(panel, impl, s, m, 0.0) for impl in IMPLS]
            continue
        fa4, ours, flops = steps(case, s, heads, 128 ** -0.5)
        on_gpu = [torch.empty(1, device="cuda")]  # timed with CUDA events
        for round_ in range(args.rounds):
            for impl, step in zip(IMPLS, (fa4, ours)):
                m = common.measure(step, [on_gpu], warmup=2, iters=args.iters)
                record["rows"].append(common.make_row(panel, impl, s, m, flops, case=case,
                                                      heads=heads, round=round_ + 1))
        del fa4, ours
        torch.cuda.empty_cache()
        print(f"[{time.monotonic() - start:6.1f}s] {panel} done", flush=True)
    record["summary"] = summary(record["rows"])
    for line in record["summary"]:
        print(line)
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    common.save(NAME, record, results_dir=args.results_dir,
                copy_to=args.copy_to, plot=reason is None, metrics=("median_ms",), bars=True)
    return 0


def summary(rows: list[dict]) -> list[dict]:
    """Per case: each implementation's median time over its rounds, and ours over FA4's."""
    out = []
    for panel in dict.fromkeys(r["panel"] for r in rows):
        ms = {impl: statistics.median(r["median_ms"] for r in rows
                                      if r["panel"] == panel and r["impl"] == impl
                                      and r["status"] == "ok") for impl in IMPLS
              if any(r["panel"] == panel and r["impl"] == impl and r["status"] == "ok"
                     for r in rows)}
        if len(ms) == len(IMPLS):
            out.append({"panel": panel, **{f"{impl} ms": round(t, 4) for impl, t in ms.items()},
                        "ours / FA4": round(ms[IMPLS[1]] / ms[IMPLS[0]], 4)})
    return out


if __name__ == "__main__":
    common.run(main)
