"""Composed masks on one GPU: TFLOP/s on the pairs a mask keeps beside causal dense attention
of the same kernel, and the ring bytes that skipped blocks do not move.

    python -m benchmarks.masks                 # one H200, 128K tokens
    python -m benchmarks.masks --tiny          # seconds on a CPU: checks the script itself

Masks (bf16, 32 heads, head dim 128, forward+backward, ``sdpa_fusion.attention(mask=)``):
  causal         causal dense (``causal=True``), the baseline of each kernel
  spans          causal | 8 bidirectional image spans of 4K tokens
  spans+docs     the same within 16 documents

TFLOP/s count the visible pairs (``AttentionSpec.flops``). Each kernel warms every mask up
once (that step's out and dQ are checked on sampled rows against fp32 math with the explicit
mask; a figure counts only when right), then times ``--runs`` rounds, each round every mask
once (``--iters`` steps back to back): a row keeps every run (``runs_ms``, ``tflops_runs``)
and reports the median with ``tflops_min``/``tflops_max``. ``vs_causal_runs`` is a mask's
TFLOP/s over causal dense of the same kernel in the same round; the goal (>= 0.8) is met
(``goal_met``) only when every round clears it. ``ring_bytes``: the K/V bytes a rank sends in forward+backward under the ring
over ``--ring-ranks`` ranks (``describe()``), beside causal dense's: the blocks no rank's
queries see make no step and move nothing.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import schedules
import sdpa_fusion
from benchmarks import common
from sdpa_fusion import masks

NAME = "masks"
K = 1024


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=128 * K)
    p.add_argument("--spans", type=int, default=8)
    p.add_argument("--span-len", type=int, default=4 * K)
    p.add_argument("--documents", type=int, default=16)
    p.add_argument("--kernels", default="cudnn,fa4,flash")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ring-ranks", type=int, default=8)
    p.add_argument("--runs", type=int, default=3, help="timed rounds (the spread)")
    p.add_argument("--iters", type=int, default=1, help="steps per timed run")
    p.add_argument("--goal", type=float, default=0.8, help="vs_causal every run must clear")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU, reference kernel")
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.span_len, args.heads, args.head_dim = 512, 16, 2, 16
        args.kernels, args.ring_ranks = "reference", 4
    return args


def mask_of(name: str, args) -> masks.Mask | None:
    """The mask of ``name`` over ``args.seq`` tokens (None: causal dense)."""
    if name == "causal":
        return None
    gap = args.seq // args.spans
    spans = [(i * gap + gap // 4, i * gap + gap // 4 + args.span_len) for i in range(args.spans)]
    mask = masks.causal() | masks.bidirectional_spans(spans)
    if name == "spans+docs":
        ids = torch.arange(args.seq) * args.documents // args.seq
        mask = mask & masks.document_ids(ids)
    return mask


@torch.no_grad()
def sampled_error(q, k, v, dout, out, dq, mask, rows: int = 32) -> float:
    """The relative error (norm of the differences over the norm of the expected values) of
    out and dQ on ``rows`` sampled query rows against fp32 math with the explicit mask (the
    row's keys as ``mask.visible`` keeps them); the larger of the two."""
    s, groups = q.shape[2], q.shape[1] // k.shape[1]
    picked = torch.linspace(0, s - 1, rows).long()
    kf, vf = (t[0].float().repeat_interleave(groups, 0) for t in (k, v))
    diffs, norms = torch.zeros(2), torch.zeros(2)
    for i in picked.tolist():
        keys = torch.arange(s)
        seen = keys <= i if mask is None else mask.visible(torch.tensor(0), torch.tensor([[i]]),
                                                           keys.unsqueeze(0))[0]
        seen = seen.to(q.device)
        qi, doi = q[0, :, i].float(), dout[0, :, i].float()
        scores = torch.einsum("he,hke->hk", qi, kf) / q.shape[-1] ** 0.5
        p = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
        o = torch.einsum("hk,hke->he", p, vf)
        dp = torch.einsum("he,hke->hk", doi, vf)
        ds = p * (dp - (doi * o).sum(-1, keepdim=True))
        dqi = torch.einsum("hk,hke->he", ds, kf) / q.shape[-1] ** 0.5
        for n, (got, want) in enumerate(((out[0, :, i], o), (dq[0, :, i], dqi))):
            diffs[n] += float((got.detach().float() - want).square().sum())
            norms[n] += float(want.square().sum())
    return float((diffs / norms.clamp_min(1e-30)).sqrt().max())


def ring_bytes(args, mask, spec) -> int:
    mesh = sdpa_fusion.VirtualMesh((args.ring_ranks,), ("seq",))
    ring = schedules.get("ring", mesh, partition="load_balanced")
    d = ring.describe(spec.replace(mask=mask, causal=mask is None))
    return d.bytes_sent + d.backward_bytes_sent


NAMES = ("causal", "spans", "spans+docs")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    q, k, v, dout = common.random_inputs(1, args.heads, args.seq, args.head_dim, dtype=dtype,
                                         device=device, layout="bshe")
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    chosen = {name: mask_of(name, args) for name in NAMES}
    spec = sdpa_fusion.plan(q, k, v, kernel="reference").spec
    moved = {name: ring_bytes(args, mask, spec) for name, mask in chosen.items()}
    rows = []
    for kernel in args.kernels.split(","):
        rows += kernel_rows(kernel, chosen, moved, (q, k, v, dout), args, tolerance)
    record = {"title": "Composed masks: TFLOP/s on visible pairs vs causal dense",
              "environment": common.environment(__name__), "settings": vars(args) | {
                  "results_dir": str(args.results_dir)}, "rows": rows}
    print(common.format_table(rows, row_keys=("panel",), col_key="impl"))
    for row in rows:
        print(f"{row['impl']:10s} {row['panel']:11s} tflops_runs {row.get('tflops_runs')} "
              f"vs_causal_runs {row.get('vs_causal_runs')} goal_met {row.get('goal_met')} "
              f"ring_bytes {row.get('ring_bytes')} error {row.get('error')}")
    common.save(NAME, record, args, bars=True)
    return 0 if all(r.get("right", False) for r in rows if r.get("status") == "ok") else 1


def kernel_rows(kernel: str, chosen: dict, moved: dict, inputs, args, tolerance) -> list:
    """The rows of one kernel: each mask warmed up and checked, then ``args.runs`` rounds
    of every mask."""
    q, k, v, dout = inputs
    rows, steps = {}, {}
    for name, mask in chosen.items():
        kw = dict(causal=True) if mask is None else dict(mask=mask)
        try:
            spec = sdpa_fusion.plan(q, k, v, kernel=kernel, **kw).spec
        except ValueError as e:
            rows[name] = {"panel": name, "impl": kernel, "seq_len": args.seq,
                          "status": f"unavailable: {e}"}
            continue

        def step(tensors, kw=kw):
            a, b, c, d = tensors
            out = sdpa_fusion.attention(a, b, c, kernel=kernel, **kw)
            return out, torch.autograd.grad(out, (a, b, c), d)

        try:
            out, (dq, _, _) = step(inputs)  # the warm-up, checked
        except Exception as e:  # noqa: BLE001 -- a failing kernel is a row
            rows[name] = common.make_row(name, kernel, args.seq, common.failure(e), 0)
            continue
        error = sampled_error(q, k, v, dout, out, dq, mask)
        del out, dq
        rows[name] = dict(flops=spec.flops(backward=True), error=error, right=error <= tolerance,
                          visible_pairs=spec.flops() / (4 * args.heads * args.head_dim))
        steps[name] = step
    runs = {name: [] for name in steps}
    for _ in range(args.runs):
        for name, step in steps.items():
            runs[name].append(common.measure(step, [inputs], warmup=0, iters=args.iters))
    for name, measured in runs.items():
        rows[name] = timed_row(name, kernel, measured, rows[name], moved[name], args)
    causal = rows.get("causal", {}).get("tflops_runs")
    for row in rows.values():
        if causal and row.get("tflops_runs") and len(causal) == len(row["tflops_runs"]):
            row["vs_causal_runs"] = [m / c for m, c in zip(row["tflops_runs"], causal)]
            row["vs_causal"] = statistics.median(row["vs_causal_runs"])
            row["goal_met"] = min(row["vs_causal_runs"]) >= args.goal
    return list(rows.values())


def timed_row(name, kernel, measured, found: dict, ring: int, args) -> dict:
    """The row of ``measured`` runs: the median run's measurement, every run's time and
    TFLOP/s, their min and max; no TFLOP/s when a run failed or the check did not pass."""
    failed = next((m for m in measured if m.status != "ok"), None)
    flops, checked = found.pop("flops"), dict(error=found.pop("error"), right=found.pop("right"))
    if failed is not None:
        return common.make_row(name, kernel, args.seq, failed, flops, ring_bytes=ring, **found)
    ms = [m.median_ms for m in measured]
    middle = measured[ms.index(statistics.median_low(ms))]
    row = common.make_row(name, kernel, args.seq, middle, flops, ring_bytes=ring, **found,
                          runs_ms=ms, tflops_runs=[common.tflops(flops, t) for t in ms])
    row.update(checked)
    row["tflops"] = common.tflops(flops, statistics.median(ms))
    row["tflops_min"], row["tflops_max"] = min(row["tflops_runs"]), max(row["tflops_runs"])
    if not row["right"]:
        row["tflops"] = row["tflops_min"] = row["tflops_max"] = row["tflops_runs"] = None
    return row


if __name__ == "__main__":
    common.run(main)
