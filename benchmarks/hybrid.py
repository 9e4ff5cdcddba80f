"""The hybrid schedule on 2-D meshes against the 1-D ring and Ulysses on the same GPUs.

    mpirun -np 2 python -m benchmarks.hybrid                  # 1x2 and 2x1; ~3 min on 2 H200s
    mpirun -np 4 python -m benchmarks.hybrid --tag _4gpu      # 1x4, 2x2, 4x1
    mpirun -np 8 python -m benchmarks.hybrid --tag _8gpu      # 1x8, 2x4, 4x2, 8x1
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
rank, buffer memory per rank), next to the measured memory (``peak_gib``, ``step_gib``).
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch

from benchmarks import common
from benchmarks import context_parallel as cp

NAME = "hybrid"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=common.int_list,
                   default=common.int_list("32k,64k,128k,256k"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=("both", "yes", "no"), default="yes")
    p.add_argument("--modes", default="fwd+bwd")
    p.add_argument("--shapes", default="",
                   help="mesh shapes IxO, e.g. 1x2,2x1 (default: every factorization)")
    p.add_argument("--inners", default="ulysses,head_parallel")
    p.add_argument("--outer", default="ring")
    p.add_argument("--baselines", default="ring,ulysses", help="1-D schedules over all ranks")
    p.add_argument("--kernel", default="auto", help="local kernel of every schedule")
    p.add_argument("--partition", default="load_balanced", help="partition option when causal")
    p.add_argument("--partition-full", default="contiguous", help="partition option when not")
    p.add_argument("--dtype", choices=sorted(cp.DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=None, help="default: 2 up to 64K, then 1")
    p.add_argument("--iters", type=int, default=None, help="default: 8 up to 64K, 5, then 3")
    p.add_argument("--check-max-seq", type=common.int_list, default=[65536])
    p.add_argument("--tag", default="", help="appended to the result name, e.g. _4gpu")
    common.add_distributed_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_lens, args.heads, args.head_dim = [64, 128], 8, 16
        args.warmup, args.iters = 1, 3
    args.modes = args.modes.split(",")
    args.inners = [s for s in args.inners.split(",") if s]
    args.baselines = [s for s in args.baselines.split(",") if s]
    args.causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
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
        record = new_record(args, line.world_size, [m.shape for m in meshes])
        deadline, start = common.Deadline(args.max_seconds), time.monotonic()
        for s in args.seq_lens:
            for causal in args.causals:
                if not line.agree(deadline.left() > 0)[0]:
                    continue
                ref = cp.reference_output(args, s, causal, line.device)
                rows = []
                for name in args.baselines:
                    rows += cp.schedule_rows(args, line, name, s, causal, ref)
                for mesh in meshes:
                    for inner in args.inners:
                        rows += hybrid_rows(args, mesh, inner, s, causal, ref)
                del ref
                if line.device.type == "cuda":
                    torch.cuda.empty_cache()
                if line.rank == 0:
                    record["rows"] += rows
                    cp.progress(start, s, causal, rows)
                    common.save(args.name, record, results_dir=args.results_dir, plot=False)
        if line.rank == 0:
            cp.finish_record(args, record, start)
    finally:
        sdpa_fusion.close_mesh()
    return 0


def new_record(args, world: int, shapes) -> dict:
    return {
        "title": f"hybrid on 2-D meshes of {world} ranks vs 1-D ring, Ulysses",
        "environment": common.environment("benchmarks.hybrid"),
        "settings": {
            "seq_lens": args.seq_lens, "batch": args.batch, "heads": args.heads,
            "head_dim": args.head_dim, "dtype": args.dtype, "modes": args.modes,
            "mesh_shapes": [list(s) for s in shapes], "mesh_dims": ["heads", "seq"],
            "inners": args.inners, "outer": args.outer, "baselines": args.baselines,
            "kernel": args.kernel, "partition_when_causal": args.partition,
            "partition_when_full": args.partition_full, "layout": "bhse",
            "iterations": {common.short(s): cp.iterations(args, s) for s in args.seq_lens},
            "check_max_seq": args.check_max_seq[0],
            "timing": ("barrier before every iteration" if args.sync_each else
                       "back-to-back iterations after a barrier")
            + "; slowest rank's median; TFLOP/s per GPU = AttentionSpec.flops of the whole "
              "problem / ranks / time",
        },
        "rows": [],
    }


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    common.run(main)
