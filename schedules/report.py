"""The plan of a schedule on a mesh, per rank (``schedules.plan``), with predicted times
(``schedules.predict``): what ``explain --mesh`` prints."""

from __future__ import annotations

import dataclasses

from sdpa_fusion.cli import spec_text
from sdpa_fusion.spec import AttentionSpec

from . import predict
from .assign import work
from .base import DESCRIBED
from .plan import mesh_names, plan_ranks

GIB = float(1 << 30)
MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class MeshReport:
    """Every rank's plan and predicted times (None when the model has no figures)."""

    schedule: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    options: dict
    spec: AttentionSpec
    plans: list
    kernel: str | None  # the kernel the prediction is for
    predicted: list[dict[str, object]] | None  # per rank: mode -> StepTime
    why_not: str = ""  # why there is no prediction

    def rows(self) -> list[dict]:
        """One dict of numbers per rank (what ``--json`` prints)."""
        rows = []
        for i, p in enumerate(self.plans):
            d, m = p.description, p.memory
            local = {k: getattr(p.local, k) for k in ("batch", "heads", "kv_heads", "q_len", "kv_len")}
            row = {"rank": p.rank, "coordinates": p.coordinates, "local": local,
                   **{k: getattr(d, k) for k in DESCRIBED}, "memory_bytes": m.forward,
                   "backward_memory_bytes": m.forward_backward}
            if self.predicted is not None:
                row.update({f"predicted_{mode}_ms": self.predicted[i][mode].seconds * 1e3
                            for mode in MODES})
            if p.local.packing is not None:
                row.update(documents(p.local.packing, p.exchange))
            rows.append(row)
        return rows


def documents(packing, exchange) -> dict:
    """What a rank holds of a packed batch: tokens, documents whole and cut (those of its
    groups, and the ranks each group is), its work and what its exchanges of the cut ones
    cost beyond it (``Assignment.exchanges``; by ``exchange`` where every document is cut),
    in pairs."""
    assignment = getattr(packing, "assignment", None)
    if assignment is not None:  # partition documents
        groups = [g for g, _, _ in packing.cuts]
        return {"tokens": packing.tokens, "whole_documents": len(packing.whole_lengths),
                "cut_documents": sum(len(assignment.cut_over(g)) for g in groups),
                "cut_over_ranks": [[first, first + size - 1] for first, size in groups],
                "work_pairs": assignment.work[packing.rank],
                "exchange_pairs": assignment.exchanges[packing.rank]}
    lengths = [n for n in packing.split.lengths.tolist() if n]  # every document is cut
    return {"tokens": packing.tokens, "whole_documents": 0, "cut_documents": len(lengths),
            "cut_over_ranks": [[0, packing.parts - 1]],
            "work_pairs": sum(work(n) for n in lengths) / packing.parts,
            "exchange_pairs": exchange.cost(packing.parts, sum(lengths),
                                            sum(lengths) / packing.parts)
            if packing.parts > 1 else 0}


def mesh_report(name: str, spec: AttentionSpec, shape: tuple[int, ...],
                names: tuple[str, ...] | None = None, options: dict | None = None,
                kernel: str = "auto") -> MeshReport:
    """Plan schedule ``name`` on a mesh of ``shape`` for global ``spec``, predicting each step."""
    options = dict(options or {})
    names = tuple(names or mesh_names(name, len(shape)))
    plans = plan_ranks(name, spec, tuple(shape), names, **options)
    try:
        chosen = predict.auto_kernel(spec.head_dim, spec.causal) if kernel == "auto" else kernel
        transport = options.get("transport", "auto")
        predicted = [{mode: predict.step_time(p, spec, mode=mode, kernel=chosen,
                                              transport=transport) for mode in MODES}
                     for p in plans]
    except ValueError as e:
        return MeshReport(name, tuple(shape), names, options, spec, plans, None, None, str(e))
    return MeshReport(name, tuple(shape), names, options, spec, plans, chosen, predicted)


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _ranks(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}" \
        if ranks == list(range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks))


def _cells(report: MeshReport, row: dict) -> list[str]:
    cells = [] if "tokens" not in row else [
        str(row["tokens"]), f"{row['whole_documents']}/{row['cut_documents']}",
        " ".join(_ranks(list(range(a, b + 1))) for a, b in row["cut_over_ranks"]) or "-",
        f"{row['work_pairs'] / 1e6:.4g}", f"{row['exchange_pairs'] / 1e6:.3g}"]
    cells += [f"{row['steps']}/{row['backward_steps']}",
             f"{_gib(row['bytes_sent'])}/{_gib(row['backward_bytes_sent'])}",
             f"{_gib(row['bytes_received'])}/{_gib(row['backward_bytes_received'])}",
             f"{row['flops'] / 1e12:.3g}/{row['backward_flops'] / 1e12:.3g}",
             f"{_gib(row['memory_bytes'])}/{_gib(row['backward_memory_bytes'])}"]
    if report.predicted is not None:
        cells.append(f"{row['predicted_fwd_ms']:.3g}/{row['predicted_fwd+bwd_ms']:.3g}")
    return cells


def table(report: MeshReport) -> list[str]:
    """The per-rank table, ranks with the same numbers on one line."""
    header = ["ranks", "steps", "GiB sent", "GiB received", "TFLOP", "memory GiB"]
    if report.spec.layout.is_varlen:
        header[1:1] = ["tokens", "documents whole/cut", "cut over", "work M pairs",
                       "exchanges M pairs"]
    if report.predicted is not None:
        header.append("predicted ms")
    groups: dict[tuple, list[int]] = {}
    for row in report.rows():
        groups.setdefault(tuple(_cells(report, row)), []).append(row["rank"])
    body = [[_ranks(ranks), *cells] for cells, ranks in groups.items()]
    widths = [max(len(x) for x in column) for column in zip(header, *body)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(header, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in body]
    return ["  " + line for line in lines]


def text(report: MeshReport) -> str:
    """The report as ``explain`` prints it."""
    spec, p0 = report.spec, report.plans[0]
    dims = " x ".join(f"{n}={s}" for n, s in zip(report.names, report.shape))
    options = "".join(f", {k}={v!r}" for k, v in report.options.items())
    lines = [f"schedule {report.schedule}{options} on a mesh {dims}: planned on a virtual mesh "
             f"(no process group, no data)",
             f"problem: {spec_text(spec)}",
             f"FLOPs of the whole problem: forward {spec.flops():.3e}, forward+backward "
             f"{spec.flops(backward=True):.3e}",
             f"local problem of rank 0: {spec_text(p0.local)}",
             "per rank (steps, GiB, TFLOP: forward/backward; memory GiB and predicted ms: "
             "forward/forward+backward):"]
    lines += table(report)
    if len(report.shape) > 1:
        lines.append(f"  rank = {report.names[0]} x {report.shape[1]} + {report.names[1]}")
    if p0.description.notes:
        lines.append(f"notes: {p0.description.notes}")
    lines.append("memory: this rank's q, k, v (and dout) and what describe().memory says the "
                 "call allocates at its peak (outputs, gradients, buffers, accumulators, kernel "
                 "workspace)")
    lines += prediction_text(report)
    return "\n".join(lines)


def prediction_text(report: MeshReport) -> list[str]:
    """The predicted times and what they are made of, as lines."""
    if report.predicted is None:
        return [f"no predicted time: {report.why_not}"]
    spec, first = report.spec, report.predicted[0]
    slowest = {mode: max(p[mode].seconds for p in report.predicted) for mode in MODES}
    per_gpu = spec.flops(backward=True) / len(report.plans) / slowest["fwd+bwd"] / 1e12
    step = first["fwd+bwd"]
    lines = [f"predicted on {predict.measured_device()} with kernel {report.kernel} (bf16 "
             f"measurements): forward {slowest['fwd'] * 1e3:.3g} ms, forward+backward "
             f"{slowest['fwd+bwd'] * 1e3:.3g} ms ({per_gpu:.0f} TFLOP/s per GPU)",
             f"  compute {step.compute_s * 1e3:.3g} ms: {step.rate.source}"]
    if step.bandwidth is not None:
        lines.append(f"  transfers {step.transfer_s * 1e3:.3g} ms not hidden: "
                     f"{step.bandwidth.source}")
    return lines
