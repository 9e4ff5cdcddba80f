"""The ``sdpa-fusion`` command (also ``python -m schedules``): the core's ``demo`` and
``explain`` (``sdpa_fusion.cli``) with predicted step times, and ``explain`` on a mesh.

    sdpa-fusion demo                      # definitions + a checked fwd/bwd run
    sdpa-fusion explain --seq 8192 --heads 32 --kv-heads 8 --layout bshe --causal
    sdpa-fusion explain --schedule ring --mesh 4 --seq 131072 --heads 32 --head-dim 128

A user's mistake is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from sdpa_fusion import cli
from sdpa_fusion.kernels import names as kernel_names
from sdpa_fusion.mesh import launch_env

from . import names, option_value, report

# explain --schedule plans for GPUs: the problem of the committed context-parallel benchmarks
PLAN_SHAPE = dict(batch=1, heads=32, kv_heads=32, seq=32768, head_dim=128)


def _mesh_shape(text: str) -> tuple[int, ...]:
    sizes = text.lower().split("x")
    if not all(s.isdigit() and int(s) > 0 for s in sizes) or len(sizes) > 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh shape; write 4 or 2x2")
    return tuple(int(s) for s in sizes)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(","))


def _option(text: str) -> tuple[str, int | str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--option {text!r} must be KEY=VALUE, e.g. transport=p2p")
    return key.strip(), option_value(value.strip())


def _documents(text: str) -> tuple[int, ...]:
    lengths = []
    for part in text.lower().split(","):
        length, _, count = part.strip().partition("x")
        if not length.isdigit() or not (count or "1").isdigit():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a list of document lengths; write e.g. 32768x2,8192x4,128")
        lengths += [int(length)] * int(count or 1)
    return tuple(lengths)


def packed_spec(spec, lengths: tuple[int, ...]):
    """``spec`` as one packed batch (layout thd) of documents of ``lengths`` tokens."""
    cu = (0, *itertools.accumulate(lengths))
    return spec.replace(batch=1, q_len=cu[-1], kv_len=cu[-1], layout="thd",
                        cu_seqlens=cu).validate()


def add_mesh_args(explain: argparse.ArgumentParser) -> None:
    """``explain``'s options of a schedule on a mesh."""
    explain.add_argument("--schedule", help="a schedule name (schedules.names()), planned per "
                                            "rank without a launcher")
    explain.add_argument("--mesh", type=_mesh_shape, help="mesh shape: 4, or 2x2 for 2-D (default: "
                                                          "the launcher's ranks, else 1)")
    explain.add_argument("--mesh-dims", type=_names,
                         help="mesh dim names, comma-separated (default: seq, or heads for "
                              "head_parallel; heads,seq on 2-D meshes)")
    explain.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                         help="a schedule option, e.g. transport=p2p or inner=head_parallel "
                              "(schedules.options(name)); repeat for more")
    explain.add_argument("--documents", type=_documents, metavar="LENxCOUNT,...",
                         help="a packed batch (layout thd) of documents of these lengths, e.g. "
                              "32768x2,8192x4,128x2048: each rank's documents, tokens and work "
                              "(with --schedule)")
    explain.add_argument("--json", action="store_true",
                         help="print the per-rank numbers as JSON (with --schedule)")


def build_parser(prog: str = "python -m schedules") -> argparse.ArgumentParser:
    return cli.build_parser(prog, extend_explain=add_mesh_args)


def explain(args: argparse.Namespace) -> int:
    """The core's ``explain`` and the predicted time on one GPU, or every rank's plan on a mesh."""
    if args.schedule or args.mesh:
        return explain_mesh(args)
    rc = cli.explain(args)
    spec = cli.spec_from_args(args, cli.device_of(args.device))
    planned = report.mesh_report("replicated", spec, (1,), kernel=args.kernel)
    print("\n".join(report.prediction_text(planned)))
    return rc


def explain_mesh(args: argparse.Namespace) -> int:
    """Every rank's plan under ``--schedule`` on a mesh of ``--mesh``, with predicted times."""
    spec = cli.spec_from_args(args, cli.device_of(args.device), PLAN_SHAPE)
    if args.documents:
        spec = packed_spec(spec, args.documents)
    if not args.schedule:
        raise ValueError("--mesh needs --schedule (a schedule to plan on it); choose one of "
                         f"{names()}")
    if args.schedule not in names():
        raise ValueError(f"--schedule {args.schedule!r} is not known; choose one of {names()}")
    if args.kernel not in kernel_names():
        raise ValueError(f"--kernel {args.kernel!r} is not known; choose one of {kernel_names()}")
    env = launch_env()
    shape = args.mesh or ((env.world_size,) if env else (1,))
    if args.mesh_dims is not None and len(args.mesh_dims) != len(shape):
        raise ValueError(f"--mesh-dims {','.join(args.mesh_dims)} names {len(args.mesh_dims)} "
                         f"dims but --mesh {'x'.join(map(str, shape))} has {len(shape)}")
    options = dict(_option(text) for text in args.option)
    planned = report.mesh_report(args.schedule, spec, shape, args.mesh_dims, options, args.kernel)
    if args.json:
        print(json.dumps({"schedule": args.schedule, "mesh": list(shape),
                          "names": list(planned.names), "options": options,
                          "kernel": planned.kernel, "ranks": planned.rows()}, indent=1))
    else:
        print(report.text(planned))
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m schedules") -> int:
    return cli.run(build_parser(prog), {"demo": cli.demo, "explain": explain}, argv)


def script() -> None:
    """The ``sdpa-fusion`` command installed with the package."""
    sys.exit(main(prog="sdpa-fusion"))
