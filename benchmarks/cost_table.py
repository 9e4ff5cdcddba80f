"""The table of measured figures that ``explain``'s cost model reads, written from benchmark
results (``schedules/cost_table.json``, read by ``schedules.predict``; not edited by hand).

    python -m benchmarks.cost_table    # from benchmarks/results: single_gpu, ring_transport, thd

Per measured device: each kernel's one-GPU TFLOP/s by (kernel, head dim, causal, mode) over
the sequence lengths it was measured at (``single_gpu.json``), and per transport one ring
shift's figures by block size (``ring_transport.json``): GB/s alone, and the share of its
time that attention running beside it does not hide, (shift during attention - attention
alone) / shift alone, within [0, 1]; and for packed batches of documents (``thd.json``, the
``auto`` rows) the share of the dense kernel's rate that a packed batch reaches, by the
batch's work-weighted document length (short documents run far below a long sequence's rate).
Each part names its result file, the command that wrote it and the git commit it ran at.
Entries of other devices already in the table are kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import COMMITTED_RESULTS
from schedules.figures import dense_rate, work_length
from schedules.predict import TABLE
from sdpa_fusion.kernels import names

ABOUT = ("figures of the cost model of explain (schedules/predict.py), written by "
         "python -m benchmarks.cost_table from the benchmark results it names; not edited by hand")
KERNELS_FROM, SHIFTS_FROM, PACKED_FROM = "single_gpu.json", "ring_transport.json", "thd.json"


def source(file: str, record: dict) -> dict:
    """Where figures come from: the result file, its command, git commit and date."""
    env = record["environment"]
    return {"file": file, "command": env.get("command"), "git_commit": env.get("git_commit"),
            "date_utc": env.get("date_utc")}


def _figure(value: float) -> float:
    return float(f"{value:.4g}")


def kernel_rates(record: dict, device: dict) -> list[dict]:
    """Per (kernel, head dim, causal, mode): TFLOP/s at each measured sequence length (the
    kernels of ``sdpa_fusion.kernels``, ``auto`` left out)."""
    kernels = set(names()) - {"auto"}
    grouped: dict[tuple, dict[int, float]] = {}
    for r in record["rows"]:
        if r["impl"] in kernels and r.get("tflops"):
            key = (r["impl"], r["head_dim"], r["causal"], r["mode"])
            grouped.setdefault(key, {})[r["seq_len"]] = r["tflops"]
    return [{"kernel": k, "head_dim": hd, "causal": causal, "mode": mode,
             "seq_lens": sorted(points), "tflops": [_figure(points[s]) for s in sorted(points)]}
            for (k, hd, causal, mode), points in sorted(grouped.items())]


def ring_shifts(record: dict, device: dict) -> list[dict]:
    """Per transport and block size: GB/s of one shift alone and the share of it that
    attention beside it does not hide (None where the block was not measured with attention)."""
    rows = [r for r in record["rows"] if r.get("median_ms")]
    attention = {r["block_bytes"]: r["median_ms"] for r in rows
                 if r["panel"] == "during attention" and r["impl"] == "attention alone"}
    during = {(r["impl"], r["block_bytes"]): r["median_ms"] for r in rows
              if r["panel"] == "during attention"}
    entries = []
    for r in sorted((r for r in rows if r["panel"] == "alone"),
                    key=lambda r: (r["impl"], r["block_bytes"])):
        b = r["block_bytes"]
        unhidden = None
        if (r["impl"], b) in during and b in attention:
            share = (during[r["impl"], b] - attention[b]) / r["median_ms"]
            unhidden = round(min(1.0, max(0.0, share)), 3)
        entries.append({"transport": r["impl"], "block_bytes": b, "gbps": _figure(r["gbps"]),
                        "unhidden": unhidden})
    return entries


def packed_shares(record: dict, device: dict) -> list[dict]:
    """Per packed batch that ``auto`` ran: its work-weighted document length and the share
    of the dense rate of the kernel it chose (the ``device``'s kernel figures at that length)
    that it reached."""
    batches = record["settings"]["batches"]
    entries = []
    for r in record["rows"]:
        if r["impl"] != "auto" or not r.get("tflops"):
            continue
        docs = batches[r["batch"]]  # [[length, count], ...]
        length = work_length([(n, c * n * n) for n, c in docs])
        kernel = r["chosen"].split()[0]
        dense, _ = dense_rate(device["kernels"]["figures"], kernel, r["head_dim"], r["causal"],
                              r["mode"], length)
        entries.append({"batch": r["batch"], "work_length": length, "kernel": kernel,
                        "share": _figure(r["tflops"] / dense)})
    return sorted(entries, key=lambda e: e["work_length"])


def device_entries(results_dir: Path) -> dict[str, dict]:
    """Device name -> its part of the table, from the results in ``results_dir``."""
    devices: dict[str, dict] = {}
    for file, part, figures in ((KERNELS_FROM, "kernels", kernel_rates),
                                (SHIFTS_FROM, "ring_shifts", ring_shifts),
                                (PACKED_FROM, "packed", packed_shares)):
        path = Path(results_dir) / file
        if not path.is_file():
            raise ValueError(f"{path} does not exist; run the benchmark that writes it "
                             f"(benchmarks/README.md) or pass --results-dir")
        record = json.loads(path.read_text())
        env = record["environment"]
        device = devices.setdefault(env["device"], {"sm": env.get("capability")})
        device[part] = {"source": source(file, record), "figures": figures(record, device)}
    return devices


def table(results_dir: Path, old: dict | None = None) -> dict:
    """The cost table: the devices of ``results_dir``'s results, and those of ``old`` (a
    table read before) that they do not measure."""
    devices = dict((old or {}).get("devices", {}))
    devices.update(device_entries(results_dir))
    return {"about": ABOUT, "devices": devices}


def dumps(value, indent: int = 0) -> str:
    """``value`` as JSON with one line per entry of figures (a short file that diffs well)."""
    pad = " " * (indent + 1)
    if isinstance(value, dict) and any(isinstance(v, dict) or _entries(v) for v in value.values()):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if _entries(value):
        items = [pad + dumps(v, indent + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    return json.dumps(value)


def _entries(value) -> bool:
    return isinstance(value, list) and any(isinstance(v, dict) for v in value)


def write(results_dir: Path = COMMITTED_RESULTS, path: Path = TABLE) -> Path:
    """Write the cost table at ``path`` from the results in ``results_dir``."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.is_file() else None
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps(table(results_dir, old)) + "\n")
    tmp.replace(path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=COMMITTED_RESULTS,
                        help=f"where {KERNELS_FROM} and {SHIFTS_FROM} are (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=TABLE, help="the table (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        path = write(args.results_dir, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({len(path.read_text().splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
