"""The goals of context parallelism, checked on the rows of ``benchmarks.context_parallel``.

Causal forward+backward, per GPU, measured side by side (one-GPU rows from ``--single-gpu``):

    speed      ring on kernel K / one GPU on K     >= 0.85 at 16K, 0.95 at 32K, 0.99 at 128K
               (one GPU alone, and every GPU of the run at once: the pace of the same GPUs)
               ring on fa4 / torch context_parallel    >= 1.15 at 16K..128K
               ring on fa4 / one GPU on cudnn          >= 1.0 from 64K
               every ring / torch context_parallel     > 1 at every length
    memory     step per GPU / one GPU's step (cudnn)   ring <= 0.6, ulysses and allgather
                                                       <= 0.75, at 128K and 256K
    precision  worst error of out, dq, dk, dv over torch's own bf16 error  <= 2

A goal whose rows are missing is not listed.
"""

from __future__ import annotations

from benchmarks import common

PANEL = "causal fwd+bwd"
K = 1024
SAME_KERNEL = {16 * K: 0.85, 32 * K: 0.95, 128 * K: 0.99}


def evaluate(rows) -> list[dict]:
    """One entry per goal and length the rows can answer: goal, seq_len, value, target, ok."""
    ok = [r for r in rows if r.get("panel") == PANEL and r.get("status") == "ok"]
    by = {(r["impl"], r["seq_len"]): r for r in ok}
    lengths = sorted({r["seq_len"] for r in ok})
    rings = sorted({r["impl"] for r in ok if r["impl"].startswith("ring")})
    out = []

    def check(goal, s, value, target, above=True):
        if value is not None:
            out.append(dict(goal=goal, seq_len=s, value=round(value, 3), target=target,
                            ok=value >= target if above else value <= target))

    def ratio(a, b, s, key="tflops"):
        ra, rb = by.get((a, s)), by.get((b, s))
        if ra and rb and ra.get(key) and rb.get(key):
            return ra[key] / rb[key]
        return None

    torch_cp = sorted({r["impl"] for r in ok if r["impl"].startswith("torch-cp")})
    for s in lengths:
        best_cp = max(torch_cp, key=lambda i: (by.get((i, s)) or {}).get("tflops") or 0,
                      default=None)
        for ring in rings:
            kernel = by[(ring, s)].get("kernel")
            if s in SAME_KERNEL:
                for one in (f"1 GPU {kernel}", f"every GPU {kernel}"):
                    check(f"{ring} / {one}", s, ratio(ring, one, s), SAME_KERNEL[s])
            if best_cp:
                target = 1.15 if kernel == "fa4" and s <= 128 * K else 1.0
                check(f"{ring} / {best_cp}", s, ratio(ring, best_cp, s), target)
            if kernel == "fa4" and s >= 64 * K:
                check(f"{ring} / 1 GPU cudnn", s, ratio(ring, "1 GPU cudnn", s), 1.0)
        if s >= 128 * K:
            for impl in [*rings, "ulysses", "allgather"]:
                target = 0.6 if impl.startswith("ring") else 0.75
                check(f"{impl} step memory / 1 GPU cudnn", s,
                      ratio(impl, "1 GPU cudnn", s, key="step_gib"), target, above=False)
        for r in ok:
            if r["seq_len"] == s and r.get("err_ratio") is not None:
                check(f"{r['impl']} error / torch bf16 error", s, r["err_ratio"], 2.0,
                      above=False)
    return out


def table(goals) -> str:
    """The goals as text, one line each."""
    lines = [f"{'goal':<48} {'s':>5} {'value':>7} {'target':>7}  met"]
    for g in goals:
        lines.append(f"{g['goal']:<48} {common.short(g['seq_len']):>5} {g['value']:>7.3f} "
                     f"{g['target']:>7.2f}  {'yes' if g['ok'] else 'NO'}")
    return "\n".join(lines)
