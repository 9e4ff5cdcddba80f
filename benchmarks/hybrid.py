"""The hybrid schedule on 2-D meshes against the 1-D ring and Ulysses on the same GPUs.

    mpirun -np 2 python -m benchmarks.hybrid                  # 1x2 and 2x1; ~3 min on 2 H200s
    mpirun -np 4 python -m benchmarks.hybrid                  # 1x4, 2x2, 4x1
    mpirun -np 8 python -m benchmarks.hybrid                  # 1x8, 2x4, 4x2, 8x1
    mpirun -np 4 --oversubscribe python -m benchmarks.hybrid --tiny   # CPU ranks

The problem: b=1, 32 heads of 128, bf16, causal, forward+backward, s = 32K..256K (the
settings of ``benchmarks.context_parallel``, whose timing and checks this reuses). Rows:
  ring, ulysses              the 1-D schedules over all ranks (``--baselines``), partition
                             load_balanced when causal, contiguous when not
  hybrid <inner> IxO         schedules.get("hybrid", init_mesh((I, O), ("heads", "seq")),
                             inner=<inner>, outer=--outer, partition=...) for every
                             --shapes entry (default: every factorization of the world) and
                             every --inners entry; I ranks split heads, O ranks the sequence
Per-GPU TFLOP/s = AttentionSpec.flops of the whole problem / ranks / the slowest rank's
median. Hybrid rows also carry what ``describe()`` promises per mesh dim (bytes moved per
rank, memory per rank), next to the measured memory (``peak_gib``, ``step_gib``).
"""

from __future__ import annotations

import argparse
import datetime

from benchmarks import common
from benchmarks import context_parallel as cp

NAME = "hybrid"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cp.add_problem_args(p, causal="yes", modes="fwd+bwd")
    p.add_argument("--shapes", default="",
                   help="mesh shapes IxO, e.g. 1x2,2x1 (default: every factorization)")
    p.add_argument("--inners", default="ulysses,head_parallel")
    p.add_argument("--outer", default="ring")
    p.add_argument("--baselines", default="ring,ulysses", help="1-D schedules over all ranks")
    args = cp.finish_problem_args(p.parse_args(argv))
    args.inners = [s for s in args.inners.split(",") if s]
    args.baselines = [s for s in args.baselines.split(",") if s]
    args.name = NAME + args.tag + ("_tiny" if args.tiny else "")
    return args


def mesh_shapes(text: str, world: int) -> list[tuple[int, int]]:
    """'1x2,2x1' as shapes; every (I, world / I) when empty."""
    if not text:
        return [(i, world // i) for i in range(1, world + 1) if world % i == 0]
    shapes = [tuple(int(n) for n in item.split("x")) for item in text.split(",") if item]
    for shape in shapes:
        if len(shape) != 2 or shape[0] * shape[1] != world:
            raise ValueError(f"--shapes entry {'x'.join(map(str, shape))} must be IxO with "
                             f"I * O = {world} ranks")
    return shapes


def hybrid_rows(args, mesh, inner, s, causal, ref) -> list[dict]:
    """Time the hybrid with ``inner`` on ``mesh`` (``cp.schedule_rows``), each row named by
    the mesh shape and carrying what ``describe()`` promises per dim."""
    import schedules

    shape = "x".join(map(str, mesh.shape))
    rows = cp.schedule_rows(args, mesh, "hybrid", s, causal, ref, inner=inner, outer=args.outer)
    described = {}
    try:
        sched, _ = cp.make_schedule(args, mesh, "hybrid", causal, inner=inner, outer=args.outer)
        for cost in sched.describe(cp.global_spec(args, s, causal)).dims:
            d = cost.description
            described[cost.dim] = {
                "schedule": d.schedule, "ranks": d.ranks, "steps": d.steps,
                "gib_sent": d.bytes_sent / common.GIB,
                "backward_gib_sent": d.backward_bytes_sent / common.GIB,
                "buffer_gib": cost.memory / common.GIB,
                "backward_buffer_gib": cost.backward_memory / common.GIB,
            }
    except ValueError as e:  # the timed rows already record the failure
        described = {"error": str(e)}
    for r in rows:
        r.update(impl=f"hybrid {inner} {shape}", mesh_shape=list(mesh.shape), described=described)
    return rows


def run(args) -> int:
    import sdpa_fusion

    timeout = datetime.timedelta(seconds=args.timeout_s)
    line = sdpa_fusion.init_mesh((-1,), ("seq",), timeout=timeout)
    try:
        meshes = [sdpa_fusion.init_mesh(shape, ("heads", "seq"), timeout=timeout)
                  for shape in mesh_shapes(args.shapes, line.world_size)]
        record = cp.new_record(
            args, f"hybrid on 2-D meshes of {line.world_size} ranks vs 1-D ring, Ulysses",
            "benchmarks.hybrid", mesh_shapes=[list(m.shape) for m in meshes],
            mesh_dims=["heads", "seq"],
            inners=args.inners, outer=args.outer, baselines=args.baselines)

        def case_rows(s, causal, ref):
            rows = []
            for name in args.baselines:
                rows += cp.schedule_rows(args, line, name, s, causal, ref)
            for mesh in meshes:
                for inner in args.inners:
                    rows += hybrid_rows(args, mesh, inner, s, causal, ref)
            return rows

        start = cp.run_cases(args, line, record, case_rows)
        if line.rank == 0:
            cp.finish_record(args, record, start)
    finally:
        sdpa_fusion.close_mesh()
    return 0


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    common.run(main)
