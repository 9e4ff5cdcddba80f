"""Context parallelism: our sequence schedules against PyTorch's context_parallel and one GPU.

    python -m benchmarks.context_parallel --single-gpu     # one-GPU baseline, ~1.5 min; first
    mpirun -np 4 python -m benchmarks.context_parallel     # the schedules, ~4-5 min on 4 H200s
    mpirun -np 4 --oversubscribe python -m benchmarks.context_parallel --tiny   # CPU ranks

The goals of context parallelism on 2 GPUs (ring on FA4 and on cuDNN, Ulysses, allgather,
torch's context_parallel; one GPU on cuDNN and on FA4), in one run of about 8 minutes
(add ``--hold-seconds 3`` to both to time every step under sustained load):

    python -m benchmarks.context_parallel --preset goals --single-gpu
    mpirun -np 2 python -m benchmarks.context_parallel --preset goals

Both steps write ``context_parallel.json`` and ``.png``: ``--single-gpu`` the one-GPU rows,
the run under mpirun its own rows and the one-GPU rows it found there (``baseline``).

The problem: b=1, 32 heads of 128, bf16, s = 32K..256K, causal and not, forward and
forward+backward. Implementations:
  ring, allgather, ulysses     sdpa_fusion.attention(..., schedule=schedules.get(name, mesh,
                               partition="load_balanced" if causal else "contiguous",
                               **options), kernel=--kernel); ``--schedules`` entries take
                               options as ``name:option=value:...`` (``kernel=`` picks the
                               local kernel of that entry: "ring:kernel=fa4",
                               "ring:transport=p2p", "ring:head_groups=4"); the row is named
                               by the entry ("ring fa4"). A name missing from
                               schedules.names() is recorded as unavailable; a schedule that
                               takes no partition option runs without it. The symmetric
                               memory of the copy-engine transport is added to its memory
  torch-cp allgather|alltoall  torch.distributed.tensor.experimental.context_parallel with
                               set_rotate_method(...), under sdpa_kernel(CUDNN_ATTENTION); its
                               head-tail load balancer when causal
  1 GPU <kernel>               the whole problem on one GPU, once per ``--kernels`` entry
                               (``--single-gpu``, a separate run without mpirun, so no rank
                               idles inside a collective); the distributed run keeps them
                               when they are of its problem
  every GPU <kernel>           the whole problem on every GPU of the run at once, each rank
                               alone (no communication), once per ``--every-gpu`` entry: what
                               one GPU does beside the others, in the same run as the
                               schedules (GPUs of one host differ by a few percent, and a
                               schedule runs at the pace of its slowest); per-GPU TFLOP/s
                               from the slowest rank
Per-GPU TFLOP/s = AttentionSpec.flops of the whole problem / ranks / the slowest rank's median
time. Timed iterations run back to back after a barrier (a training loop's steady state);
``--sync-each`` puts a barrier before every iteration instead. ``--hold-seconds S`` runs each
step untimed for S seconds first: under sustained load a GPU settles at the clock its power
limit allows, lower than in the first second. Each row records the GPUs' SM clock, power,
temperature and how often a power or thermal limit held the clock down over its timed
iterations (``gpus``, ``benchmarks.telemetry``). Memory: ``peak_gib`` is the largest
``max_memory_allocated`` of any rank over the timed iterations, ``step_gib`` that peak minus
what was allocated before them (the step's own memory; kept symmetric memory added). PyTorch's
context_parallel shards its buffers in place with ``resize_``, which keeps each buffer's full
storage, so compare ``step_gib`` there. Up to ``--check-max-seq`` every implementation's out,
dq, dk, dv are compared with the fp32 attention of the whole problem, next to torch's own bf16
error (``errors``, ``err_ratio``: worst error over torch's; ``benchmarks.precision``). The
goals (``benchmarks.cp_goals``) are evaluated on the rows and printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import common, cp_goals, precision

NAME = "context_parallel"
SCHEDULES = ("ring", "allgather", "ulysses")
TORCH_ROTATES = ("allgather", "alltoall")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRESETS = {
    "goals": {
        "doc": "the comparison the goals of context parallelism ask for: s = 16K..256K, "
               "causal forward+backward; ring on fa4 and on cudnn, ulysses, allgather "
               "(kernel auto), torch's context_parallel (all-to-all rotation); one GPU on "
               "cudnn and fa4 (--single-gpu); precision checked up to 32K",
        "seq_lens": common.int_list("16k,32k,64k,128k,256k"), "causal": "yes",
        "modes": "fwd+bwd", "schedules": "ring:kernel=fa4,ring:kernel=cudnn,ulysses,allgather",
        "torch_cp": "alltoall", "kernels": "cudnn,fa4", "every_gpu": "cudnn,fa4",
        "check_max_seq": [32768],
    },
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_problem_args(p, causal="both", modes="fwd,fwd+bwd")
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help="our schedules to run, each 'name[:option=value...]'")
    p.add_argument("--torch-cp", default=",".join(TORCH_ROTATES),
                   help="rotate methods of torch's context_parallel to run ('' for none)")
    p.add_argument("--kernels", default=None,
                   help="--single-gpu: the kernels of the one-GPU rows (default: --kernel)")
    p.add_argument("--every-gpu", default="",
                   help="kernels of 'every GPU <kernel>' rows: the whole problem on every GPU "
                        "at once, each alone ('' for none)")
    p.add_argument("--single-gpu", action="store_true",
                   help="run the one-GPU baseline (no mpirun) into context_parallel.json, whose "
                        "one-GPU rows the run under mpirun then keeps")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="goals: " + PRESETS["goals"]["doc"])
    args = p.parse_args(argv)
    for key, value in PRESETS.get(args.preset, {}).items():
        if key != "doc":
            setattr(args, key, value)
    args = finish_problem_args(args)
    args.schedules = [impl_options(s) for s in args.schedules.split(",") if s]
    args.torch_cp = [s for s in args.torch_cp.split(",") if s]
    args.kernels = [k for k in (args.kernels or args.kernel).split(",") if k]
    args.every_gpu = [k for k in args.every_gpu.split(",") if k]
    args.name = NAME + args.tag + ("_tiny" if args.tiny else "")
    return args


def impl_options(text: str) -> tuple[str, dict]:
    """'ring:kernel=fa4:head_groups=4' -> ("ring", {"kernel": "fa4", "head_groups": 4})."""
    import schedules

    name, *items = text.split(":")
    options = {}
    for item in items:
        key, _, value = item.partition("=")
        options[key] = schedules.option_value(value)
    return name, options


def add_problem_args(p, *, causal: str, modes: str) -> None:
    """The problem, kernel, partition and timing options (shared with benchmarks.hybrid),
    then ``common.add_distributed_args``."""
    p.add_argument("--seq-lens", type=common.int_list,
                   default=common.int_list("32k,64k,128k,256k"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=("both", "yes", "no"), default=causal)
    p.add_argument("--modes", default=modes)
    p.add_argument("--kernel", default="auto", help="local kernel of our schedules")
    p.add_argument("--partition", default="load_balanced", help="partition option when causal")
    p.add_argument("--partition-full", default="contiguous", help="partition option when not")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=None, help="default: 2 up to 64K, then 1")
    p.add_argument("--iters", type=int, default=None, help="default: 8 up to 64K, 5, then 3")
    p.add_argument("--hold-seconds", type=float, default=0.0,
                   help="run each step back to back this long before timing it (the clock "
                        "GPUs keep under sustained load; default 0: time right after warm-up)")
    p.add_argument("--check-max-seq", type=common.int_list, default=[65536])
    p.add_argument("--tag", default="",
                   help="appended to the result name, for an ad-hoc run beside the committed one")
    common.add_distributed_args(p)


def finish_problem_args(args):
    """``--tiny`` shapes, and the lists the options of ``add_problem_args`` name."""
    if args.tiny:
        args.seq_lens, args.heads, args.head_dim = [64, 128], 8, 16
        args.warmup, args.iters = 1, 3
    args.modes = args.modes.split(",")
    args.causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return args


def iterations(args, s: int) -> tuple[int, int]:
    """(warmup, timed iterations) at sequence length ``s``: fewer as the steps grow long."""
    warmup = args.warmup if args.warmup is not None else (2 if s <= 65536 else 1)
    iters = args.iters if args.iters is not None else (8 if s <= 65536 else 5 if s <= 131072 else 3)
    return warmup, iters


def global_spec(args, s: int, causal: bool):
    from sdpa_fusion import AttentionSpec

    return AttentionSpec(batch=args.batch, heads=args.heads, kv_heads=args.heads, q_len=s,
                         kv_len=s, head_dim=args.head_dim, dtype=DTYPES[args.dtype],
                         causal=causal, layout="bhse")


def full_inputs(args, s, device):
    return common.random_inputs(args.batch, args.heads, s, args.head_dim,
                                dtype=DTYPES[args.dtype], device=device, requires_grad=False)


def leaves(tensors):
    """q, k, v as fresh leaves that require grad, and dout."""
    q, k, v, dout = (t.detach() for t in tensors)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def train(fn):
    def step(x):
        q, k, v, dout = x
        return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    return step


def by_mode(fn):
    return {"fwd": lambda x: fn(x[0], x[1], x[2]), "fwd+bwd": train(fn)}


def panel(causal: bool, mode: str) -> str:
    return f"{'causal' if causal else 'full'} {mode}"


def reference_output(args, s, causal, device):
    """fp32 results of the whole problem and torch's own errors (``precision.Reference``),
    the same on every rank; None above ``--check-max-seq``."""
    if s > args.check_max_seq[0]:
        return None
    return precision.Reference.of(*full_inputs(args, s, device), causal)


def checked(fn, inputs, unshard, ref) -> dict:
    """``errors`` (precision.Reference.errors of the unsharded out and gradients of one
    forward+backward of ``fn``) and ``rel_err`` (of out), or {} when unchecked or failed."""
    if ref is None:
        return {}
    try:
        q, k, v, dout = inputs
        out = fn(q, k, v)
        got = [unshard(t) for t in (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))]
        errors = ref.errors(got)
        return {"errors": errors, "err_ratio": errors["ratio"], "rel_err": errors["out"]}
    except Exception as e:  # noqa: BLE001 -- the timed run records the failure
        print(f"check failed: {type(e).__name__}: {e}", flush=True)
        return {}


# ---- one GPU ------------------------------------------------------------------------------
def single_gpu(args) -> int:
    import sdpa_fusion

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = ["reference"] if device.type == "cpu" else args.kernels
    record = new_record(args, f"one device, kernels {', '.join(kernels)}",
                        "benchmarks.context_parallel")
    deadline, start = common.Deadline(args.max_seconds), time.monotonic()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    each = dict(before_each=sync) if args.sync_each else dict(before_timing=sync)
    for s in args.seq_lens:
        warmup, iters = iterations(args, s)
        for causal in args.causals:
            if deadline.left() <= 0:
                continue
            spec, ref = global_spec(args, s, causal), reference_output(args, s, causal, device)
            for name, kernel in zip(args.kernels, kernels):
                rows = one_gpu_rows(args, s, causal, name, kernel, ref, each, spec, device)
                record["rows"] += rows
                progress(start, s, causal, rows)
            del ref
            common.save(args.name, record, args, plot=False)
    return finish_record(args, record, start)


def one_gpu_rows(args, s, causal, name, kernel, ref, each, spec, device) -> list[dict]:
    """Rows "1 GPU <name>" of the whole problem on one device with ``kernel``."""
    import sdpa_fusion

    warmup, iters = iterations(args, s)

    def fn(q, k, v):
        return sdpa_fusion.attention(q, k, v, causal=causal, kernel=kernel)

    inputs, error, checks = whole_problem(args, s, device, fn, ref)
    rows = []
    for mode in args.modes:
        m = (common.measure(by_mode(fn)[mode], inputs, warmup=warmup, iters=iters,
                            hold_s=args.hold_seconds, **each) if inputs else error)
        rows.append(common.make_row(panel(causal, mode), f"1 GPU {name}", s, m,
                                    spec.flops(backward=mode == "fwd+bwd"), mode=mode, ranks=1,
                                    kernel=kernel, **checks, **fields(args)))
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def whole_problem(args, s, device, fn, ref):
    """(input sets, None, checks of ``fn``) of the whole problem on ``device``, or (None, the
    failure, {}) when it does not fit."""
    try:
        inputs = [leaves(full_inputs(args, s, device))]
        return inputs, None, checked(fn, inputs[0], lambda t: t, ref)
    except Exception as e:  # noqa: BLE001 -- does not fit: recorded
        return None, common.failure(e), {}


# ---- several GPUs -------------------------------------------------------------------------
def schedule_rows(args, mesh, name, s, causal, ref, **options) -> list[dict]:
    """Time our schedule ``name`` (with ``options``) in every mode."""
    import schedules
    import sdpa_fusion

    impl = " ".join([name, *map(str, options.values())])
    kernel = options.pop("kernel", args.kernel)
    kernel = kernel if mesh.device.type == "cuda" else "auto"  # CPU ranks: the reference
    if name not in schedules.names():
        m = common.Measurement(status="unavailable", error=f"schedule {name!r} is not registered "
                               f"(schedules.names() = {schedules.names()})")
        return [row(args, mesh, impl, s, causal, mode, m) for mode in args.modes]
    try:
        sched, options = make_schedule(args, mesh, name, causal, **options)
        full = full_inputs(args, s, mesh.device)
        inputs = [leaves([sched.shard(t, layout="bhse").detach().clone() for t in full])]
        del full
    except Exception as e:  # noqa: BLE001 -- the same on every rank: recorded
        return [row(args, mesh, impl, s, causal, mode, common.failure(e)) for mode in args.modes]

    def fn(q, k, v):
        return sdpa_fusion.attention(q, k, v, causal=causal, kernel=kernel, schedule=sched)

    checks = checked(fn, inputs[0], lambda t: sched.unshard(t, layout="bhse"), ref)
    described = described_memory(sched, args, s, causal)
    rows = [timed_row(args, mesh, impl, s, causal, mode, step, inputs, **checks,
                      options=options, kernel=kernel, extra_gib=symmetric_gib(sched),
                      **described)
            for mode, step in by_mode(fn).items() if mode in args.modes]
    del inputs
    return rows


def every_gpu_rows(args, mesh, kernel, s, causal, ref) -> list[dict]:
    """Rows "every GPU <kernel>": the whole problem on every rank's GPU at once, each rank
    alone; per-GPU TFLOP/s and memory of the slowest rank."""
    import sdpa_fusion

    kernel_used = kernel if mesh.device.type == "cuda" else "reference"
    impl = f"every GPU {kernel}"

    def fn(q, k, v):
        return sdpa_fusion.attention(q, k, v, causal=causal, kernel=kernel_used)

    inputs, error, checks = whole_problem(args, s, mesh.device, fn, ref)
    failed = [rank for rank, ok in enumerate(mesh.agree(inputs is not None)) if not ok]
    if failed and inputs is not None:  # every rank records the failure, none times alone
        inputs, error = None, common.failure(RuntimeError(f"rank {failed[0]} failed"))
    rows = [timed_row(args, mesh, impl, s, causal, mode, step, inputs, alone=True,
                      kernel=kernel_used, **checks) if inputs is not None
            else row(args, mesh, impl, s, causal, mode, error, alone=True, kernel=kernel_used)
            for mode, step in by_mode(fn).items() if mode in args.modes]
    del inputs
    return rows


def described_memory(sched, args, s, causal) -> dict:
    """What ``describe()`` says the schedule's step takes per rank (GiB), when it says."""
    try:
        memory = sched.describe(global_spec(args, s, causal)).memory
    except Exception:  # noqa: BLE001 -- a schedule without an answer
        memory = None
    return {} if memory is None else {"described_step_gib": memory.step / common.GIB}


def symmetric_gib(sched):
    """GiB the schedule keeps outside the caching allocator (the ring's symmetric memory),
    so outside max_memory_allocated: added to the row's memory."""
    return lambda: getattr(sched, "kept_bytes", 0) / common.GIB


def make_schedule(args, mesh, name, causal, **extra):
    """(schedule, options it took): with the partition option (and ``extra``), or without
    the partition when it takes none."""
    import schedules

    options = {"partition": args.partition if causal else args.partition_full, **extra}
    try:
        sched = schedules.get(name, mesh, **options)
    except TypeError:
        options = extra
        sched = schedules.get(name, mesh, **options)
    partition = getattr(sched, "partition", None)
    return sched, {**options, "partition_used": getattr(partition, "name", partition)}


def torch_cp_api():
    """(context_parallel, context_parallel_unshard, set_rotate_method, options) from torch,
    looked up defensively: the API is experimental and moves between releases."""
    where = ("torch.distributed.tensor.experimental._attention",
             "torch.distributed.tensor.experimental._context_parallel._attention")
    missing = []
    for module_name in where:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            missing.append(f"{module_name}: {e}")
            continue
        names = ("context_parallel", "context_parallel_unshard", "set_rotate_method", "_cp_options")
        found = [getattr(module, n, None) for n in names]
        if all(x is not None for x in found):
            return tuple(found)
        missing.append(f"{module_name} lacks context_parallel/context_parallel_unshard/"
                       f"set_rotate_method/_cp_options")
    raise ImportError("; ".join(missing))


def torch_cp_rows(args, mesh, rotate, s, causal, ref) -> list[dict]:
    """Time torch's context_parallel with ``rotate`` ("allgather" | "alltoall") in every mode.

    Its buffers are sharded in place on entry, so it gets plain tensors and the leaves are
    made inside the context (as torchtitan does). Its load balancer (head-tail) is on for
    causal attention and must be off otherwise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    impl = f"torch-cp {rotate}"
    try:
        context_parallel, unshard, set_rotate_method, options = torch_cp_api()
    except ImportError as e:
        return [row(args, mesh, impl, s, causal, mode, common.failure(e)) for mode in args.modes]
    saved = (options.enable_load_balance, options.rotate_method)
    rows = []
    try:
        set_rotate_method(rotate)
        options.enable_load_balance = causal
        buffers = list(full_inputs(args, s, mesh.device))
        backend = SDPBackend.CUDNN_ATTENTION if mesh.device.type == "cuda" else SDPBackend.MATH
        with sdpa_kernel(backend), context_parallel(
            mesh.torch_mesh, buffers=buffers, buffer_seq_dims=[2] * 4,
            no_restore_buffers=set(buffers),
        ):
            inputs = [leaves(buffers)]

            def fn(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            checks = checked(fn, inputs[0],
                             lambda t: unshard(mesh.torch_mesh, [t], [2])[0], ref)
            for mode, step in by_mode(fn).items():
                if mode in args.modes:
                    rows.append(timed_row(args, mesh, impl, s, causal, mode, step, inputs,
                                          **checks, kernel=f"torch {backend.name}"))
            del inputs
    except Exception as e:  # noqa: BLE001 -- recorded; every rank fails alike
        done = {r["mode"] for r in rows}
        rows += [row(args, mesh, impl, s, causal, mode, common.failure(e))
                 for mode in args.modes if mode not in done]
    finally:
        options.enable_load_balance, options.rotate_method = saved
    return rows


def timed_row(args, mesh, impl, s, causal, mode, step, inputs, extra_gib=None, **extra) -> dict:
    """A timed row; ``extra_gib()`` (GiB of memory outside the caching allocator, such as
    symmetric memory) is added to the peak and the step memory."""
    warmup, iters = iterations(args, s)
    each = dict(before_each=dist.barrier) if args.sync_each else dict(before_timing=dist.barrier)
    m = common.measure(step, inputs, warmup=warmup, iters=iters, hold_s=args.hold_seconds,
                       agree=lambda go: any(mesh.agree(go)), **each)
    if extra_gib is not None and m.peak_gib is not None:
        gib = extra_gib()
        m = dataclasses.replace(m, peak_gib=m.peak_gib + gib, step_gib=m.step_gib + gib)
        extra["symmetric_gib"] = gib
    return row(args, mesh, impl, s, causal, mode, common.combine_ranks(mesh.agree(m)), **extra)


def row(args, mesh, impl, s, causal, mode, m, *, alone: bool = False, **extra) -> dict:
    """A row of ``m``: per-GPU TFLOP/s of the whole problem shared by the ranks, or (``alone``)
    run by each rank on its own."""
    flops = global_spec(args, s, causal).flops(backward=mode == "fwd+bwd")
    flops /= 1 if alone else mesh.world_size
    return common.make_row(panel(causal, mode), impl, s, m, flops, mode=mode,
                           ranks=mesh.world_size, **fields(args), **extra)


def fields(args) -> dict:
    return dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)


def distributed(args) -> int:
    import sdpa_fusion

    timeout = datetime.timedelta(seconds=args.timeout_s)
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",), timeout=timeout)
    try:
        record = new_record(args, f"context parallel over {mesh.world_size} ranks",
                            "benchmarks.context_parallel")

        def case_rows(s, causal, ref):
            rows = []
            for name, options in args.schedules:
                rows += schedule_rows(args, mesh, name, s, causal, ref, **options)
            for rotate in args.torch_cp:
                rows += torch_cp_rows(args, mesh, rotate, s, causal, ref)
            for kernel in args.every_gpu:
                rows += every_gpu_rows(args, mesh, kernel, s, causal, ref)
            return rows

        baseline = one_gpu_baseline(args, record) if mesh.rank == 0 else ([], None)
        start = run_cases(args, mesh, record, case_rows)
        if mesh.rank == 0:
            record["rows"] += baseline[0]
            record["baseline"] = baseline[1]
            finish_record(args, record, start)
    finally:
        sdpa_fusion.close_mesh()
    return 0


def run_cases(args, mesh, record, case_rows) -> float:
    """Every (sequence length, causal) case until ``--max-seconds``: ``case_rows(s, causal,
    ref)`` gives its rows (``ref``: the one-device output, see ``reference_output``), which
    rank 0 adds to ``record``, saving as it goes. Returns the start time."""
    deadline, start = common.Deadline(args.max_seconds), time.monotonic()
    for s in args.seq_lens:
        for causal in args.causals:
            if not mesh.agree(deadline.left() > 0)[0]:
                continue
            ref = reference_output(args, s, causal, mesh.device)
            rows = case_rows(s, causal, ref)
            del ref
            if mesh.device.type == "cuda":
                torch.cuda.empty_cache()
            if mesh.rank == 0:
                record["rows"] += rows
                progress(start, s, causal, rows)
                common.save(args.name, record, args, plot=False)
    return start


# ---- records ------------------------------------------------------------------------------
def new_record(args, title, module, **settings) -> dict:
    """A record of this benchmark's settings (``settings``: a caller's own, by default the
    schedules of ``parse_args``)."""
    settings = settings or {"schedules": [":".join([n, *(f"{k}={v}" for k, v in o.items())])
                                          for n, o in args.schedules],
                            "torch_cp": args.torch_cp, "one_gpu_kernels": args.kernels,
                            "preset": args.preset}
    return {
        "title": title,
        "environment": common.environment(module),
        "settings": {
            "seq_lens": args.seq_lens, "batch": args.batch, "heads": args.heads,
            "head_dim": args.head_dim, "dtype": args.dtype, "modes": args.modes,
            **settings, "kernel": args.kernel,
            "partition_when_causal": args.partition, "partition_when_full": args.partition_full,
            "layout": "bhse",
            "iterations": {common.short(s): iterations(args, s) for s in args.seq_lens},
            "check_max_seq": args.check_max_seq[0],
            "hold_seconds": args.hold_seconds,
            "timing": ("barrier before every iteration" if args.sync_each else
                       "back-to-back iterations after a barrier")
            + (f", after {args.hold_seconds:g} s of untimed steps" if args.hold_seconds else "")
            + "; slowest rank's median; TFLOP/s per GPU = AttentionSpec.flops of the whole "
              "problem / ranks / time",
        },
        "rows": [],
    }


def one_gpu_baseline(args, record) -> tuple[list[dict], dict | str]:
    """(rows, where they come from) of the one-GPU baseline in ``<name>.json``: the rows
    "1 GPU <kernel>" that ``--single-gpu`` wrote there (or that an earlier run merged), when
    they are of this problem; else no rows and why. Read before this run writes that file."""
    path = args.results_dir / f"{args.name}.json"
    if not path.exists():
        return [], f"{path.name} not found; run with --single-gpu first"
    base = json.loads(path.read_text())
    keys = ("batch", "heads", "head_dim", "dtype")
    if any(base["settings"].get(k) != record["settings"][k] for k in keys):
        return [], f"{path.name} is for another problem ({keys} differ); not merged"
    rows = [r for r in base["rows"] if r["impl"].startswith("1 GPU") and r.get("ranks") == 1]
    if not rows:
        return [], f"{path.name} has no one-GPU rows; run with --single-gpu first"
    merged = base.get("baseline")
    environment = merged["environment"] if isinstance(merged, dict) else base["environment"]
    origin = environment.get("command")
    return ([dict(r, baseline_from=r.get("baseline_from") or origin) for r in rows],
            {"file": path.name, "environment": environment})


def memory_lines(rows, ranks: int) -> list[dict]:
    """Rows for the memory plot: each one-GPU step, and 1/P of it (what P GPUs should take)."""
    lines = []
    for r in rows:
        if r["impl"].startswith("1 GPU") and r.get("step_gib") is not None:
            lines.append(dict(r, impl=f"{r['impl']} / {ranks}", tflops=None,
                              step_gib=r["step_gib"] / ranks, derived=True))
    return lines


def progress(start, s, causal, rows) -> None:
    cells = ", ".join(f"{r['impl']}:{r['mode']}="
                      + (common.number(r["tflops"]) if r["tflops"] else r["status"]) for r in rows)
    print(f"[{time.monotonic() - start:6.1f}s] s={common.short(s)} causal={causal}: {cells}",
          flush=True)


def finish_record(args, record, start) -> int:
    rows = record["rows"]
    # per-GPU TFLOP/s of each implementation over the first one-GPU row's (the first
    # --kernels entry) at the same size
    first = next((r["impl"] for r in rows if r["impl"].startswith("1 GPU")), None)
    record["ratios"] = common.ratios(rows, lambda r: None if r["impl"].startswith("1 GPU")
                                     else first)
    record["goals"] = cp_goals.evaluate(rows)
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    paths = common.save(args.name, record, args, plot=False)
    ranks = max((r.get("ranks") or 1 for r in rows), default=1)
    drawn = dict(record, rows=rows + (memory_lines(rows, ranks) if ranks > 1 else []))
    try:
        paths.append(common.plot_record(drawn, args.results_dir / f"{args.name}.png",
                                        metrics=("tflops", "step_gib")))
    except Exception as e:  # noqa: BLE001 -- the JSON matters more than the picture
        print(f"warning: could not draw {args.name}.png: {type(e).__name__}: {e}")
    common.copy_files(paths, args.copy_to)
    print("\nTFLOP/s per GPU")
    print(common.format_table(rows, row_keys=("panel", "seq_len")))
    print("\nstep memory per GPU, GiB (kept symmetric memory included; peak_gib in the JSON)")
    print(common.format_table(rows, row_keys=("panel", "seq_len"), value="step_gib", fmt="{:.2f}"))
    if record["ratios"]:
        print("\nper-GPU TFLOP/s / one GPU")
        print(common.format_table(record["ratios"], row_keys=("panel", "seq_len"), value="ratio",
                                  fmt="{:.2f}"))
    print_clocks(rows)
    bad = [r for r in rows if r.get("rel_err") is not None and not r["rel_err"] < 2e-2]
    for r in bad:
        print(f"SUSPECT: {r['impl']} {r['panel']} s={r['seq_len']}: rel_err={r['rel_err']:.3g}")
    if record["goals"]:
        print("\ngoals (causal fwd+bwd)")
        print(cp_goals.table(record["goals"]))
    common.print_failures(rows)
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {record['elapsed_s']} s")
    return 0


def print_clocks(rows) -> None:
    """The GPUs' SM clock and power over each row's timed iterations, where recorded."""
    clocked = [r for r in rows if r.get("gpus")]
    if not clocked:
        return
    print("\nGPU clocks over the timed iterations (mean SM clock, mean power, share of samples "
          "a power or thermal limit held the clock down)")
    for r in clocked:
        gpus = ", ".join(f"GPU {i} {g['sm_mhz']} MHz {g['power_w']} W {g['limited']:.0%}"
                         for i, g in r["gpus"].items())
        print(f"  {r['impl']:28} {common.short(r['seq_len']):>5}: {gpus}")


def main(argv=None) -> int:
    args = parse_args(argv)
    return single_gpu(args) if args.single_gpu else distributed(args)


if __name__ == "__main__":
    common.run(main)
