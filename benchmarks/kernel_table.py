"""The kernel table ``auto`` ranks kernels by, written from single-GPU benchmark results.

``sdpa_fusion/kernels/measured_tflops.json`` (read by ``sdpa_fusion.kernels.ranking``) holds,
per device, head dim and causal flag, the mean forward+backward TFLOP/s of each kernel.
``benchmarks.single_gpu`` writes it while it runs and from a saved result
(``--kernel-table-from``), so every figure in it comes from a measurement.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from sdpa_fusion.kernels import names, ranking

ABOUT = ("forward+backward TFLOP/s of each kernel (mean over its seq_lens), written by "
         "benchmarks/single_gpu.py from its results; kernel='auto' tries the fastest first "
         "(sdpa_fusion/kernels/ranking.py). Not edited by hand.")


def kernel_table(record) -> list[dict]:
    """Entries of the kernel table from a single-GPU result: per (head dim, causal), the
    mean forward+backward TFLOP/s of each kernel (those named in sdpa_fusion.kernels, auto
    left out) over the sequence lengths it was measured at (``seq_lens``; the benchmark runs
    the slower kernels up to 32K only, the fast ones to 128K)."""
    kernels = set(names()) - {"auto"}
    env = record["environment"]
    source = {k: env.get(k) for k in ("date_utc", "command", "git_commit", "torch", "cudnn")}
    grouped = {}
    for r in record["rows"]:
        if r["impl"] in kernels and r["mode"] == "fwd+bwd" and r["tflops"] is not None:
            key = (r["head_dim"], r["causal"])
            grouped.setdefault(key, {}).setdefault(r["impl"], {})[r["seq_len"]] = r["tflops"]
    entries = []
    for (hd, causal), per_kernel in sorted(grouped.items()):
        ordered = sorted(per_kernel.items())
        tflops = {k: float(f"{statistics.fmean(by_length.values()):.4g}")
                  for k, by_length in ordered}
        lengths = {k: sorted(by_length) for k, by_length in ordered}
        entries.append({"device": env["device"], "sm": env.get("capability"), "head_dim": hd,
                        "causal": causal, "tflops": tflops, "seq_lens": lengths,
                        "source": source})
    return entries


def write_kernel_table(record, path: Path) -> Path:
    """Put ``kernel_table(record)`` into the table at ``path``, replacing the entries of the
    same device, head dim and causal flag and keeping all others."""
    path = Path(path)
    new = kernel_table(record)
    replaced = {(e["device"], e["head_dim"], e["causal"]) for e in new}
    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    kept = [e for e in old if (e["device"], e["head_dim"], e["causal"]) not in replaced]
    entries = sorted(kept + new, key=lambda e: (e["device"], e["head_dim"], e["causal"]))
    table = {"about": ABOUT, "entries": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)
    ranking.load_table.cache_clear()
    return path
