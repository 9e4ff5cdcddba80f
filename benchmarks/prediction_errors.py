"""How far ``explain``'s predicted step times are from the committed measurements of our
schedules, which the model never sees (its figures are one-GPU kernel rates and ring shifts:
``schedules/cost_table.json``).

    python -m benchmarks.prediction_errors                               # the table (markdown)
    python -m benchmarks.prediction_errors --update docs/benchmarks.md   # into the doc

Each measured step is predicted again for the kernel it ran on (the row's, or for ``auto`` the
one it picked: cuDNN before FlashAttention-4 was installed with the benchmarks) and its
schedule's transport; the error is predicted / measured - 1 (negative: the model is
optimistic).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.common import COMMITTED_RESULTS
from schedules import predict
from schedules.plan import plan_ranks
from sdpa_fusion import kernels
from sdpa_fusion.spec import AttentionSpec

FILES = ("head_parallel.json", "context_parallel.json", "hybrid.json")  # our dense steps
BEGIN, END = "<!-- prediction_errors: begin -->", "<!-- prediction_errors: end -->"
COMMAND = "python -m benchmarks.prediction_errors --update docs/benchmarks.md"


@dataclasses.dataclass(frozen=True)
class Case:
    """One committed measurement of a schedule's step."""

    file: str
    impl: str
    schedule: str
    shape: tuple[int, ...]
    options: tuple[tuple[str, str], ...]
    spec: AttentionSpec
    mode: str
    kernel: str
    measured_ms: float


def configuration(row: dict) -> tuple[str, tuple[int, ...], dict] | None:
    """(schedule, mesh shape, options) a result row measured; None for rows of other things
    (PyTorch's context_parallel, one GPU's kernels beside a schedule, every GPU alone)."""
    words, ranks = row["impl"].split(), row.get("ranks", 1)
    if words[0] == "ring":  # the transport it took; else copy engines when it held symmetric
        transport = (row.get("options") or {}).get("transport") or (  # memory, else NCCL
            "copy_engine" if row.get("symmetric_gib") else "p2p")
        return "ring", (ranks,), {"transport": transport}
    if words[0] in ("allgather", "ulysses") or row["impl"] == "head_parallel auto":
        return words[0], (ranks,), {}
    if words[0] == "hybrid":
        return "hybrid", tuple(map(int, words[2].split("x"))), {"inner": words[1]}
    if row["impl"].startswith("1 GPU ") and ranks == 1:
        return "replicated", (1,), {}
    return None


def kernel_of(row: dict, record: dict) -> str:
    """The kernel a row ran on: its own when it names one, else what ``auto`` picked then
    (FlashAttention-4 where it was installed, cuDNN before)."""
    if row.get("kernel") in set(kernels.names()) - {"auto"}:
        return row["kernel"]
    return "fa4" if record["environment"].get("flash_attn_4") else "cudnn"


def cases(results_dir: Path = COMMITTED_RESULTS) -> list[Case]:
    """Every committed measurement of our schedules' dense steps in ``FILES``."""
    found = []
    for file in FILES:
        record = json.loads((Path(results_dir) / file).read_text())
        for row in record["rows"]:
            config = configuration(row)
            if config is None or row["status"] != "ok":
                continue
            name, shape, options = config
            causal = row.get("causal", row["panel"].startswith("causal"))
            spec = AttentionSpec(batch=row["batch"], heads=row["heads"], kv_heads=row["heads"],
                                 q_len=row["seq_len"], kv_len=row["seq_len"],
                                 head_dim=row["head_dim"], causal=causal, dtype=torch.bfloat16)
            found.append(Case(file, row["impl"], name, shape, tuple(sorted(options.items())),
                              spec, row["mode"], kernel_of(row, record), row["median_ms"]))
    return found


@functools.lru_cache(maxsize=None)
def _plans(name: str, spec: AttentionSpec, shape: tuple[int, ...], inner: str | None):
    return plan_ranks(name, spec, shape, **({"inner": inner} if inner else {}))


def predicted_ms(case: Case) -> float:
    """The model's step time of ``case``: its slowest rank's."""
    options = dict(case.options)
    plans = _plans(case.schedule, case.spec, case.shape, options.get("inner"))
    return 1e3 * max(predict.step_time(p, case.spec, mode=case.mode, kernel=case.kernel,
                                       transport=options.get("transport", "auto")).seconds
                     for p in plans)


def errors(results_dir: Path = COMMITTED_RESULTS) -> list[tuple[Case, float]]:
    """(case, predicted / measured - 1) of every committed measurement."""
    return [(c, predicted_ms(c) / c.measured_ms - 1) for c in cases(results_dir)]


def _lengths(group: list[Case]) -> str:
    lengths = sorted({c.spec.q_len // 1024 for c in group})
    return f"{lengths[0]}K" if len(lengths) == 1 else f"{lengths[0]}K-{lengths[-1]}K"


def table(found: list[tuple[Case, float]]) -> list[str]:
    """Markdown lines: per result file, implementation and mode, the errors' median and
    range, then all of them together."""
    groups: dict[tuple, list[tuple[Case, float]]] = {}
    for case, error in found:
        groups.setdefault((case.file, case.impl, case.mode), []).append((case, error))
    lines = ["| results | implementation | mode | GPUs | lengths | n | median error | range |",
             "|---|---|---|---|---|---|---|---|"]
    for (file, impl, mode), group in groups.items():
        measured, errs = [c for c, _ in group], [e for _, e in group]
        gpus = sorted({math.prod(c.shape) for c in measured})
        lines.append(f"| `{file}` | {impl} | {mode} | {','.join(map(str, gpus))} | "
                     f"{_lengths(measured)} | {len(group)} | {statistics.median(errs):+.1%} | "
                     f"{min(errs):+.1%} .. {max(errs):+.1%} |")
    every = [e for _, e in found]
    lines.append(f"| all | | | | | {len(every)} | {statistics.median(every):+.1%} "
                 f"(\\|error\\| {statistics.median(map(abs, every)):.1%}) | "
                 f"{min(every):+.1%} .. {max(every):+.1%} |")
    return lines


def results_commit(results_dir: Path = COMMITTED_RESULTS) -> str:
    """The last commit that changed ``results_dir`` ("?" outside a git checkout)."""
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%h", "--", str(results_dir)],
                              cwd=results_dir, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "?"
    return done.stdout.strip() or "?"


def block(results_dir: Path = COMMITTED_RESULTS) -> str:
    """The table with where it comes from, as the doc holds it."""
    return "\n".join([f"Generated by `{COMMAND}` from the results in `benchmarks/results` at "
                      f"commit {results_commit(results_dir)}:", "", *table(errors(results_dir))])


def update(doc: Path, text: str) -> None:
    """Put ``text`` between the marks ``BEGIN`` and ``END`` of ``doc``."""
    doc = Path(doc)
    old = doc.read_text()
    if old.count(BEGIN) != 1 or old.count(END) != 1:
        raise ValueError(f"{doc} must hold the marks {BEGIN} and {END} once each, around the "
                         f"table they replace")
    head, rest = old.split(BEGIN)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END)[1]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prediction_errors",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=COMMITTED_RESULTS,
                        help="where the measurements are (default: %(default)s)")
    parser.add_argument("--update", type=Path, metavar="DOC",
                        help=f"write the table into DOC between {BEGIN} and {END}")
    args = parser.parse_args(argv)
    text = block(args.results_dir)
    if args.update is None:
        print(text)
        return 0
    try:
        update(args.update, text)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"updated {args.update}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
