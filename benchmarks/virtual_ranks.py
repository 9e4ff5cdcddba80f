"""Packed batches split over P virtual ranks on one GPU: each rank's step timed alone.

    python -m benchmarks.virtual_ranks --ranks 2,4,8 --batches a,b,c,d \\
        --schedules ring:grad_dtype=input,ulysses                               # one H200
    python -m benchmarks.virtual_ranks --tiny                                   # CPU smoke
    python -m benchmarks.virtual_ranks --shrink 16 --heads 2 --head-dim 16 \\
        --kernel reference                                                      # CPU, medium

Each of the P ranks of ``schedules.get(schedule, VirtualMesh(rank=r), partition=...)`` runs
on the one device (``benchmarks.mailbox``). Record: the P ranks run causal fwd+bwd together,
one thread each and one at a time, their transfers handed over and recorded; each rank's
out and gradients are checked on sampled rows against fp32 math (``benchmarks.check``).
Replay: each rank alone runs the step again, timed, its receives copied from its record (a
copy stands for each transfer; on a side stream beside the rank's work, as the copy-engine
transport runs transfers, or with ``--transfers inline`` on its own stream); then once more,
checked. Records kept past ``--record-gib``
(default: half the memory free when the row starts) are made again by another record run;
a record run out of memory runs again keeping half of what it had kept (the ranks' own
work on the one device needs the rest).
Every row frees all it made before the next starts, a failed one (out of memory) too, and is
recorded as such. A row is the slowest rank's median time next to one
GPU's on the whole batch (same run): the goal is slowest x P <= 1.1 x one GPU. ``--runs N``
measures every row N times, each pass with a one-GPU step of its own, and keeps the N ratios
(``slowest_x_p_over_one_gpu_runs``: the goals' spread, ``docs/tables.py``). With
``--profile`` (once every rank of the row is timed: the profiler slows the steps timed
after it) each rank's device time of two more steps, back to back, is split into
attention kernels, device-to-device copies and the rest, beside the device's idle time and
the largest kernels of the rest (``device_time``); the host's time to issue one step and the
places where a step waits for the device are taken (``host_time``, with where the host's
time goes by package and function: ``host_profile``), and the step's time as one CUDA graph
replayed without the host (``graph_time``); and the caching allocator's device calls over
the timed steps are counted (``allocator_events``).

Batches (bf16, 32 heads of 128): a 15 documents of 1K-32K; b 2048 x 128; c 6 of 8K-24K
and 1,500 of 16-600; d log-normal lengths (median 600, sigma 1.2) in [16, 65536] packed to
262,144 tokens. One line per phase and per row is printed as it ends; the JSON is written
after every row, the PNG at the end (``benchmarks.common.save``).
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import statistics
import threading
import time

import torch

from benchmarks import check, common
from benchmarks.context_parallel import impl_options
from benchmarks.mailbox import TRANSFERS, Mailbox, Stopped, virtual_schedules
from benchmarks.thd import BATCHES, TINY_BATCHES

NAME = "virtual_ranks"
RECORD_HALVINGS = 3  # a record phase out of memory runs again keeping half the receives


def batches(tiny: bool, shrink: int = 1) -> dict[str, list[int]]:
    """The four packed batches of ``benchmarks.thd`` (their document lengths, each divided by
    ``shrink``), or small ones for ``tiny``."""
    if tiny:
        return {"a": [64, 32, 48], "b": [8] * 64, "c": TINY_BATCHES["c"], "d": TINY_BATCHES["d"]}
    return {name: [max(1, n // shrink) for n in BATCHES[name]] for name in "abcd"}


def free(device) -> None:
    """Give back what the last row held: its reference cycles (a failure's traceback holds
    every frame's tensors) and, on a GPU, the cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def record_bytes(args) -> float:
    """Receives one record run may keep: ``--record-gib``, else half the free memory now."""
    if args.record_gib is not None:
        return args.record_gib * common.GIB
    if args.device.type == "cuda":
        return torch.cuda.mem_get_info(args.device)[0] / 2
    return 8 * common.GIB


# ---- one rank's step --------------------------------------------------------------------
def check_rank(problem: check.Problem, local, out, dq, dk, dv) -> dict:
    """One rank's out and gradients [T_local, H, E] on sampled rows against fp32 math."""
    return check.check_packed_rank(problem, local.token_index, out, dq, dk, dv)


def direct_step(args, sched, inputs, cu):
    """(local packing, out, dq, dk, dv) of ``sched``'s rank: its forward and backward called
    in this thread (autograd would run a CUDA backward on its own device thread, where one
    waiting rank would block every other)."""
    import sdpa_fusion

    local = sched.pack(cu)
    q, k, v, dout = (local.shard(t) for t in inputs)
    p = sdpa_fusion.plan(q, k, v, layout="thd", causal=True, kernel=args.kernel,
                         schedule=sched, cu_seqlens=local)
    kept = {"kept": {}} if sched.keeps_forward else {}  # as attention's autograd keeps it
    out, lse = sched.forward(q, k, v, p.spec, p.kernel, **kept)
    return (local, out, *sched.backward(dout, q, k, v, out, lse, p.spec, p.kernel, **kept))


def record(args, scheds, inputs, cu, box: Mailbox, problem) -> list[dict | None]:
    """Every virtual rank's step once, a thread each, one at a time (``box.baton``); each
    rank's check report when ``problem`` is given."""
    reports, errors = [None] * len(scheds), []

    def rank(r):
        try:
            with box.baton(r):
                local, *results = direct_step(args, scheds[r], inputs, cu)
                if problem is not None:
                    reports[r] = check_rank(problem, local, *results)
        except BaseException as e:  # noqa: BLE001 -- raised again below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(len(scheds))]
    for t in threads:
        t.start()
    end = time.monotonic() + args.timeout_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    if any(t.is_alive() for t in threads):
        with box.turn:
            box.failed = TimeoutError("the record phase ran too long")
            box.turn.notify_all()
        raise TimeoutError(f"the record phase ran past --timeout-s={args.timeout_s:.0f}")
    if errors:  # the rank that failed first, not those it stopped
        raise next((e for e in errors if not isinstance(e, Stopped)), errors[0])
    return reports


def replay(args, sched, inputs, cu, box: Mailbox, problem):
    """(measurement, check report, profile) of ``sched``'s rank alone, its receives from
    ``box``; ``profile()`` gives with ``--profile`` the split of its device time
    (``device_time``, ``host_time``, ``graph_time``) and the ``allocator_events`` of the
    timed steps (None without): called once every rank is timed, as the profiler slows the
    steps timed after it."""
    import sdpa_fusion

    local = sched.pack(cu)
    leaves = [local.shard(t).detach() for t in inputs]
    box.replay(sched.index)

    def step(x):
        box.cursor = 0
        q, k, v = (t.requires_grad_() for t in x[:3])
        out = sdpa_fusion.attention(q, k, v, layout="thd", causal=True, kernel=args.kernel,
                                    schedule=sched, cu_seqlens=local)
        return (out, *torch.autograd.grad(out, (q, k, v), x[3]))

    before = allocator_events(leaves[0].device)
    m = common.measure(step, [leaves], warmup=args.warmup, iters=args.iters, min_iters=2,
                       budget_s=args.budget_s)
    timed = allocator_events(leaves[0].device, since=before)
    report = check_rank(problem, local, *(t.detach() for t in step(leaves)))

    def profile():
        if not args.profile:
            return None
        box.replay(sched.index)
        return dict(device_time(step, leaves), **host_time(step, leaves),
                    **graph_time(step, leaves), allocator=timed)

    return m, report, profile


def allocator_events(device, since: dict | None = None) -> dict:
    """How often the CUDA caching allocator called cudaMalloc and cudaFree (each may wait for
    the device) and retried an allocation after freeing its cache, on ``device`` (counts since
    ``since`` when given; zeros off CUDA)."""
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    counts = {name: stats.get(key, 0) for name, key in (("mallocs", "num_device_alloc"),
                                                        ("frees", "num_device_free"),
                                                        ("retries", "num_alloc_retries"))}
    return counts if since is None else {k: v - since[k] for k, v in counts.items()}


TOP_OTHER = 8  # kernels outside attention named in a profiled step's split
PROFILED_STEPS = 2  # steps profiled back to back (the idle between them counts)
ATTENTION_KERNELS = ("flash", "fmha", "cudnn", "attention")  # kernel names of attention cores


def device_time(step, leaves) -> dict:
    """The device time of a ``step`` in ms (torch.profiler; the mean of ``PROFILED_STEPS``
    run back to back, as the timed ones are), split by ``kind_of``: attention kernels,
    device-to-device copies (the copies that stand for transfers, and contiguous copies of
    tensors) and the rest (merges, sums, gathers); ``idle``, the time between the first
    step's first device work and the last step's last when the device ran nothing
    (``idle_ms``: waiting for the host, or for a synchronisation, within a step or between
    two); ``ops``, the kernels, copies and sets the device ran; and ``largest_other``, the
    ``TOP_OTHER`` kernels outside attention that took the most time, [name, ms]."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if leaves[0].is_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step(leaves)
        if leaves[0].is_cuda:
            torch.cuda.synchronize()
    split = dict(attention=0.0, copies=0.0, other=0.0)
    spans, rest = [], collections.Counter()
    for e in prof.events():
        us = e.device_time if e.device_type == torch.autograd.DeviceType.CUDA else 0.0
        if not us:
            continue
        kind = kind_of(e.name)
        split[kind] += us / 1e3
        if kind != "attention":
            rest[e.name[:80]] += us / 1e3
        spans.append((e.time_range.start, e.time_range.end))
    split["idle"] = idle_ms(spans)
    times = {k: round(v / PROFILED_STEPS, 3) for k, v in split.items()}
    times["ops"] = len(spans) / PROFILED_STEPS
    times["largest_other"] = [[name, round(ms / PROFILED_STEPS, 3)]
                              for name, ms in rest.most_common(TOP_OTHER)]
    return times


HOST_STEPS = 3  # steps whose host time is taken (host_time)


def host_time(step, leaves) -> dict:
    """``host_ms``: the host's own time to issue one ``step`` (the median of ``HOST_STEPS``,
    each issued after the device finished the last, so that the host never waits for it);
    where it exceeds the step's device time, the device idles in a loop of steps. ``syncs``:
    where a step waits for the device ([file:line, times per step], from torch's sync debug
    mode); each wait idles the device. Empty off CUDA."""
    import warnings

    if not leaves[0].is_cuda:
        return {}
    times = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(HOST_STEPS):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                start = time.perf_counter()
                step(leaves)
                times.append(time.perf_counter() - start)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = collections.Counter(f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    return dict(host_ms=round(statistics.median(times) * 1e3, 3),
                syncs=[[where, n / HOST_STEPS] for where, n in syncs.most_common()],
                **host_profile(step, leaves))


HOST_TOP = 12  # functions of the most host time kept (host_profile)


def host_profile(step, leaves) -> dict:
    """Where the host's time to issue one more ``step`` goes (cProfile, each function's own
    time in ms): ``host_by_package`` sums it by top-level package (``schedules``, ``torch``,
    ``flash_attn``, ...; builtins and torch's C++ ops as ``~``), ``host_top`` the
    ``HOST_TOP`` functions of the most own time."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if leaves[0].is_cuda else (lambda: None)
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    step(leaves)
    profiler.disable()
    sync()
    own = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, _, own s, cum s, _)
    packages, functions = collections.Counter(), collections.Counter()
    for (path, line, name), (_, _, own_s, _, _) in own.items():
        packages[_package(path)] += own_s * 1e3
        functions[f"{'/'.join(path.rsplit('/', 2)[-2:])}:{line}({name})"] += own_s * 1e3
    return dict(host_by_package={k: round(v, 3) for k, v in packages.most_common()},
                host_top=[[k, round(v, 3)] for k, v in functions.most_common(HOST_TOP)])


def _package(path: str) -> str:
    """The top-level package of the source file ``path`` ("~": builtins, C++ ops)."""
    if path == "~" or not path.endswith(".py"):
        return "~"
    parts = path.split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return parts[parts.index(marker) + 1].removesuffix(".py")
    here = [p for p in ("schedules", "sdpa_fusion", "benchmarks") if p in parts]
    if here:
        return here[-1]
    return "stdlib" if any(p.startswith("python3") for p in parts[:-1]) else parts[-1]


GRAPH_STEPS = 20  # replays of a captured step timed back to back (graph_time)


def graph_time(step, leaves) -> dict:
    """``graph_ms``: the median time of ``step`` captured in one CUDA graph and replayed
    ``GRAPH_STEPS`` times back to back: the device's own time for the step in a loop, with
    the host's work taken away; ``graph_vs_step``: the largest difference of the replay's
    outputs from an uncaptured step's (the same kernels on the same inputs, so only the order
    of atomic adds may differ). ``graph_error`` instead where the step cannot be captured.
    Empty off CUDA."""
    if not leaves[0].is_cuda:
        return {}
    want = [t.detach().clone() for t in step(leaves)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm-up off the default stream, as capture asks
        step(leaves)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            got = step(leaves)
    except Exception as e:  # noqa: BLE001 -- recorded: this step cannot be captured
        torch.cuda.synchronize()
        return dict(graph_error=f"{type(e).__name__}: {e}"[:300])
    graph.replay()
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(GRAPH_STEPS)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return dict(graph_ms=round(statistics.median(s.elapsed_time(e) for s, e in events), 3),
                graph_vs_step=diff)


def idle_ms(spans) -> float:
    """The time in ms (spans in us) between the first start and the last end that no span
    covers."""
    idle, reached = 0.0, None
    for start, end in sorted(spans):
        if reached is not None and start > reached:
            idle += start - reached
        reached = end if reached is None else max(reached, end)
    return idle / 1e3


def kind_of(kernel: str) -> str:
    """What a device kernel named ``kernel`` does: "attention" (``ATTENTION_KERNELS`` in its
    name), "copies" (device-to-device memcpy) or "other"."""
    name = kernel.lower()
    if any(k in name for k in ATTENTION_KERNELS):
        return "attention"
    return "copies" if "memcpy dtod" in name else "other"


# ---- rows -------------------------------------------------------------------------------
def partition_of(text: str):
    """A partition from its name and options: "documents:groups=False" is
    ``Documents(groups=False)``."""
    from schedules import partition

    name, options = impl_options(text)
    return type(partition.get(name))(**options) if options else partition.get(name)


def ranks_row(args, schedule, parts, partition, inputs, cu, problem, say) -> dict:
    """The row of ``schedule`` on ``parts`` virtual ranks: each rank recorded, then timed
    alone and checked; the slowest kept."""
    left, per_rank, recorded, replayed = list(range(parts)), [None] * parts, None, [None] * parts
    tokens, sent, received, runs, kept = [0] * parts, [0] * parts, [0] * parts, 0, []
    device_ms, terms = [None] * parts, None
    name, options = impl_options(schedule)
    free(args.device)  # the last row's cycles, before the budget is read
    budget, halved = record_bytes(args), 0
    try:
        while left:
            box = Mailbox(parts, recording=left, budget=budget, timeout_s=args.timeout_s,
                          transfers=args.transfers)
            start = time.monotonic()
            scheds = virtual_schedules(name, parts, inputs[0].device, box, cu,
                                       partition=partition_of(partition), **options)
            try:
                reports = record(args, scheds, inputs, cu, box, problem if runs == 0 else None)
            except torch.OutOfMemoryError:
                if not box.kept or halved == RECORD_HALVINGS:
                    raise
                held = box.kept  # the records take what the ranks' own work needs
            else:
                held = None
            if held is not None:
                del scheds, box
                free(args.device)
                budget, halved = held / 2, halved + 1
                say(f"record ran out of memory keeping {held / common.GIB:.1f} GiB of "
                    f"receives; again, keeping at most {budget / common.GIB:.1f} GiB")
                continue
            runs += 1
            if runs == 1:
                recorded = check.merge(reports)
                tokens = [s.pack(cu).tokens for s in scheds]
                assignment = getattr(scheds[0].pack(cu), "assignment", None)
                terms = None if assignment is None else [
                    assignment.cost_terms(r) for r in range(parts)]
                sent = [s.comm.bytes_sent for s in scheds]
                received = [s.comm.bytes_received for s in scheds]
            done = box.recorded
            kept.append(round(box.kept / common.GIB, 3))
            say(f"record {runs}: {parts} ranks ran, ranks {done} recorded "
                f"({box.kept / common.GIB:.1f} GiB), {time.monotonic() - start:.1f} s"
                + (f", {check.line(recorded)}" if runs == 1 else ""))
            if not done:
                raise RuntimeError(f"one rank's receives ({max(received) / common.GIB:.2f} "
                                   f"GiB) exceed the record budget {budget / common.GIB:.2f} "
                                   f"GiB; raise --record-gib")
            profiles = {}
            for r in done:
                start = time.monotonic()
                per_rank[r], replayed[r], profiles[r] = replay(args, scheds[r], inputs, cu,
                                                               box, problem)
                say(f"rank {r}: {tokens[r]} tokens, {common.number(per_rank[r].median_ms)} ms "
                    f"({per_rank[r].status}), {check.line(replayed[r])}, "
                    f"{time.monotonic() - start:.1f} s")
            for r in done:  # every rank timed before any is profiled
                device_ms[r] = profiles.pop(r)()
                box.drop(r)
                if device_ms[r]:
                    say(f"rank {r}: device ms {device_ms[r]}")
            left = [r for r in left if r not in done]
            del scheds, box, reports
        m = common.combine_ranks(per_rank)
        checks = check.merge([recorded, *replayed])
        m = check.judged(m, checks)
    except Exception as e:  # noqa: BLE001 -- recorded
        m, checks = common.failure(e), None
    return dict(measurement=m, schedule=schedule, partition=partition, ranks=parts,
                record_runs=runs,
                record_gib=kept, record_budget_gib=round(budget / common.GIB, 3),
                rank_tokens=tokens, rank_cost_terms=terms,
                bytes_sent_per_rank=sent, bytes_received_per_rank=received,
                rank_ms=[x.median_ms if x else None for x in per_rank],
                rank_device_ms=device_ms if args.profile else None,
                check_record=None if recorded is None else check.line(recorded),
                check=None if checks is None else check.line(checks))


def batch_rows(args, batch: str, lengths: list[int], say, keep) -> None:
    """The rows of one batch: one GPU on the whole batch, then every (partition, P); each
    row handed to ``keep`` as it is made. With ``--runs N`` all of it N times, each later
    pass adding its ratio to the first pass's row (``keep(None)``: a row changed)."""
    import sdpa_fusion

    g = torch.Generator(device=args.device).manual_seed(0)
    total = sum(lengths)
    inputs = [torch.randn(total, args.heads, args.head_dim, device=args.device, generator=g)
              .to(args.dtype) for _ in range(4)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=args.device)
    problem = check.packed_problem(*inputs, cu.tolist(), causal=True)
    spec = sdpa_fusion.AttentionSpec.from_tensors(*inputs[:3], layout="thd", cu_seqlens=cu,
                                                  causal=True)
    flops = spec.flops(backward=True)
    fields = dict(batch=batch, documents=len(lengths), tokens=total, heads=args.heads,
                  head_dim=args.head_dim, dtype=str(args.dtype), mode="fwd+bwd")
    panel, mean = f"batch {batch} ({len(lengths)} documents)", total // len(lengths)

    def whole(x):
        q, k, v = (t.detach().requires_grad_() for t in x[:3])
        out = sdpa_fusion.attention(q, k, v, layout="thd", causal=True, kernel=args.kernel,
                                    cu_seqlens=cu)
        return torch.autograd.grad(out, (q, k, v), x[3])

    rows = {}  # name -> the row of the first pass, which later passes add their ratio to
    for run in range(args.runs):
        start = time.monotonic()
        before = allocator_events(inputs[0].device)
        one = common.measure(whole, [inputs], warmup=args.warmup, iters=args.iters,
                             min_iters=2, budget_s=args.budget_s)
        allocator = allocator_events(inputs[0].device, since=before)
        say(f"batch {batch}{_pass(args, run)}: {len(lengths)} documents, {total} tokens; one "
            f"device {common.number(one.median_ms)} ms ({one.status}), "
            f"{time.monotonic() - start:.1f} s")
        if run == 0:
            keep(common.make_row(panel, f"1 GPU {args.kernel}", mean, one, flops, ranks=1,
                                 allocator=allocator, **fields))
        for schedule, partition, parts in itertools.product(args.schedules, args.partitions,
                                                            args.ranks):
            name = f"{schedule} {partition} P={parts}"
            if out_of_time(args):
                say(f"{batch} {name}{_pass(args, run)}: not started (--max-seconds)")
                continue

            def step_say(text, name=name):
                say(f"  {batch} {name} {text}")

            row = ranks_row(args, schedule, parts, partition, inputs, cu, problem, step_say)
            m = row.pop("measurement")
            ratio = (m.median_ms * parts / one.median_ms) if m.median_ms and one.median_ms \
                else None
            if name in rows:
                rows[name]["slowest_x_p_over_one_gpu_runs"].append(ratio)
                keep(None)
            else:
                rows[name] = common.make_row(
                    panel, name, mean, m, flops / parts, slowest_x_p_over_one_gpu=ratio,
                    slowest_x_p_over_one_gpu_runs=[ratio], goal=1.1, **row, **fields)
                keep(rows[name])
            say(f"{batch} {name}{_pass(args, run)}: slowest {common.number(m.median_ms)} ms x "
                f"{parts} / one device = {common.number(ratio)} (goal 1.1), {m.status}"
                + (f": {m.error}" if m.error else ""))


def _pass(args, run: int) -> str:
    """`` (pass i of n)`` when ``--runs`` asks for several passes."""
    return f" (pass {run + 1} of {args.runs})" if args.runs > 1 else ""


def out_of_time(args) -> bool:
    """Whether ``--max-seconds`` have passed since the run began (no new row then)."""
    return args.deadline is not None and time.monotonic() > args.deadline


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=common.int_list, default=[2, 4, 8])
    p.add_argument("--batches", default="a,b,c,d")
    p.add_argument("--partitions", default="documents,load_balanced",
                   help="partitions, each with options (documents:groups=False)")
    p.add_argument("--schedules", default="ring",
                   help="ring, allgather, ulysses, or several (comma), each with options "
                        "(ring:grad_dtype=input, ulysses:head_groups=2)")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--shrink", type=int, default=1,
                   help="divide every document length by this (CPU runs of medium size)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=100,
                   help="timed iterations at most (a short step takes this many, so that its "
                        "median holds still; a long one as many as --budget-s allows, at "
                        "least 2)")
    p.add_argument("--budget-s", type=float, default=0.5,
                   help="seconds of timed iterations per step (fewer where a step is long)")
    p.add_argument("--record-gib", type=float, default=None,
                   help="receives kept per record run (default: half the free GPU memory)")
    p.add_argument("--timeout-s", type=float, default=120,
                   help="the longest a record phase or a rank's wait for a transfer may take")
    p.add_argument("--max-seconds", type=float, default=0,
                   help="start no row after this long (0: no limit)")
    p.add_argument("--runs", type=int, default=1,
                   help="measure every row this many times, each pass with its own one-GPU "
                        "step (the goals' spread; the first pass's row is kept whole)")
    p.add_argument("--transfers", choices=TRANSFERS, default="side",
                   help="where a timed rank's receives run: side, on a side stream beside "
                        "its work as the copy-engine transport runs transfers; inline, on "
                        "its own stream where it makes them")
    p.add_argument("--profile", action="store_true",
                   help="also split each rank's device time (attention, copies, the rest)")
    p.add_argument("--tiny", action="store_true", help="small batches, reference kernel, CPU")
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.batches = [b for b in args.batches.split(",") if b]
    args.partitions = [x for x in args.partitions.split(",") if x]
    args.schedules = [x for x in args.schedules.split(",") if x]
    args.deadline = None  # main sets it from --max-seconds when the run begins
    cuda = torch.cuda.is_available() and not args.tiny
    args.device = torch.device("cuda" if cuda else "cpu")
    args.dtype = torch.bfloat16 if cuda else torch.float32
    if args.tiny:
        args.heads, args.head_dim, args.kernel = 4, 16, "reference"
        args.warmup, args.iters = 0, 1
        args.ranks = [r for r in args.ranks if r <= 4]
    args.name = NAME + ("_tiny" if args.tiny else "")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    record_ = {"title": f"packed batches over virtual ranks ({', '.join(args.schedules)}), "
                        f"one device",
               "environment": common.environment("benchmarks.virtual_ranks"),
               "settings": {k: str(v) if isinstance(v, (torch.dtype, torch.device)) else v
                            for k, v in vars(args).items() if k not in ("results_dir", "deadline")},
               "rows": []}

    def say(text):
        print(f"[{time.monotonic() - start:6.1f}s] {text}", flush=True)

    def keep(row):
        """Add ``row`` (None: a row already kept changed) and write the JSON."""
        if row is not None:
            record_["rows"].append(row)
        record_["elapsed_s"] = round(time.monotonic() - start, 1)
        common.save(args.name, record_, args, plot=False)

    lengths = batches(args.tiny, args.shrink)
    args.deadline = start + args.max_seconds if args.max_seconds else None
    for batch in args.batches:
        if out_of_time(args):
            say(f"batch {batch}: not started (--max-seconds)")
            continue
        try:
            batch_rows(args, batch, lengths[batch], say, keep)
        except Exception as e:  # noqa: BLE001 -- the batch's inputs did not fit: recorded
            m = common.failure(e)
            panel = f"batch {batch} ({len(lengths[batch])} documents)"
            keep(common.make_row(panel, f"1 GPU {args.kernel}", 0, m, 0.0, ranks=1,
                                 batch=batch))
            say(f"batch {batch}: {m.status}: {m.error}")
        free(args.device)
    paths = common.save(args.name, record_, args, metrics=("tflops",), bars=True)
    print(common.format_table(record_["rows"], row_keys=("panel",)))
    common.print_failures(record_["rows"])
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    common.run(main)
