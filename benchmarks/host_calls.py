"""The host's time per call of the pieces a sequence schedule's step is made of, on one device.

    python -m benchmarks.host_calls            # one GPU: every kernel it has
    python -m benchmarks.host_calls --tiny     # CPU smoke (reference kernel)

A rank's step at P = 8 on a packed batch issues 30-220 device ops (``virtual_ranks
--profile``: ``ops``), and there its host can take as long as its device. Each piece here is
issued ``--calls`` times back to back while the device is busy (on a GPU behind
``torch.cuda._sleep``, so that no call waits for the device): ``host_us`` is the host's time
per call and ``device_us`` the device's (CUDA events around the calls; on CPU the wall time
again). A piece whose host time exceeds its device time leaves the device idle in a loop of
it. Pieces: one torch op on one element; each kernel's packed forward and backward on one
packed batch (``--lengths``); a merge fold into an fp32 accumulator (nvFuser on GPUs); and the
batch through ``sdpa_fusion.attention`` forward and backward, its offsets a tuple (the call's
plan kept) and a list (planned on every call), its out and gradients checked on sampled rows
against fp32 math (a wrong one recorded as such, with no figure).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from benchmarks import check, common

NAME = "host_calls"
KERNELS = ("fa4", "cudnn", "flash")  # the GPU kernels timed, where this machine has them
SLEEP_CYCLES = 1_000_000_000  # the device's wait ahead of the calls (about 0.5 s on an H200)


def lengths_of(text: str) -> list[int]:
    """'2048,300x3' -> [2048, 300, 300, 300]."""
    out = []
    for item in text.split(","):
        n, _, times = item.strip().partition("x")
        out += [int(n)] * int(times or 1)
    return out


def timed(fn, calls: int, device) -> tuple[float, float]:
    """(host us, device us) per call of ``fn`` issued ``calls`` times back to back, after two
    warm-up calls; on a GPU the device waits ``SLEEP_CYCLES`` first, so the host never does."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = (time.perf_counter() - start) / calls * 1e6
        return wall, wall
    torch.cuda.synchronize(device)
    torch.cuda._sleep(SLEEP_CYCLES)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    end.record()
    torch.cuda.synchronize(device)
    return host, begin.elapsed_time(end) * 1e3 / calls


def pieces(args, q, k, v, dout, cu):
    """[(name, kernel name or None, fn, check)]: what is timed; ``check`` (or None) returns
    the check report of one more call."""
    import sdpa_fusion
    from sdpa_fusion import kernels, merge
    from schedules.calls import as_block

    one = torch.zeros(1, device=q.device)
    seqlens = kernels.Seqlens(tuple(cu), tuple(cu))
    scale = q.shape[-1] ** -0.5
    out = []
    out.append(("torch op (one element)", None, lambda: one.add_(1), None))
    for name in args.kernels:
        try:
            kernel = kernels.get(name)
            o, lse = kernel.varlen_forward(q, k, v, seqlens, causal=True, scale=scale)
        except Exception as e:  # noqa: BLE001 -- recorded (main): not on this machine
            out.append((f"{name} packed forward", name, _raising(e), None))
            continue
        grads = [torch.empty_like(t) for t in (q, k, v)]
        out.append((f"{name} packed forward", name,
                    lambda kernel=kernel, o=o, lse=lse: kernel.varlen_forward(
                        q, k, v, seqlens, causal=True, scale=scale, out=o, lse=lse), None))
        out.append((f"{name} packed backward", name,
                    lambda kernel=kernel, o=o, lse=lse, g=grads: kernel.varlen_backward(
                        dout, q, k, v, o, lse, seqlens, causal=True, scale=scale, dq=g[0],
                        dk=g[1], dv=g[2]), None))
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.zeros((1, q.shape[1], q.shape[0]), device=q.device)
    block_lse = torch.zeros_like(acc_lse)
    out.append(("merge fold (fp32)", None,
                lambda: merge.fold(as_block(acc), acc_lse, as_block(q), block_lse), None))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def attention(offsets):
        o = sdpa_fusion.attention(*leaves, layout="thd", causal=True, kernel=args.kernel,
                                  cu_seqlens=offsets)
        return (o, *torch.autograd.grad(o, leaves, dout))

    def checked(offsets):
        results = [t.detach() for t in attention(offsets)]
        return check.check_packed(q, k, v, dout, *results, cu).as_dict()

    # offsets as a tuple: the call's plan is kept (every layer of a step after the first);
    # as a list: planned on every call (docs/api.md). A GPU tensor would cost a device sync.
    for offsets, how in ((tuple(cu), "a tuple: plan kept"), (list(cu), "a list: planned")):
        out.append((f"attention {args.kernel} fwd+bwd (offsets {how})", args.kernel,
                    lambda offsets=offsets: attention(offsets),
                    lambda offsets=offsets: checked(offsets)))
    return out


def _raising(error: Exception):
    """A piece that raises ``error`` when timed (its row records the failure)."""
    def fn():
        raise error
    return fn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048x2,1024,512,300x40",
                   help="the packed batch's documents (300x40: forty of 300 tokens)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernels", default=",".join(KERNELS), help="kernels whose calls are timed")
    p.add_argument("--kernel", default="auto", help="the kernel of the attention row")
    p.add_argument("--calls", type=int, default=40, help="calls per piece, back to back")
    p.add_argument("--tiny", action="store_true", help="small batch, reference kernel, CPU")
    p.add_argument("--tag", default="", help="write host_calls<tag>.json, beside the default's")
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.kernels = [k for k in args.kernels.split(",") if k]
    cuda = torch.cuda.is_available() and not args.tiny
    args.device = torch.device("cuda" if cuda else "cpu")
    args.dtype = torch.bfloat16 if cuda else torch.float32
    if args.tiny:
        args.lengths, args.heads, args.head_dim = "8,3,1,0,5", 2, 8
        args.kernels, args.kernel, args.calls = ["reference"], "reference", 3
    args.name = NAME + args.tag + ("_tiny" if args.tiny else "")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    lengths = lengths_of(args.lengths)
    cu = [0, *itertools.accumulate(lengths)]
    g = torch.Generator(device=args.device).manual_seed(0)
    q, k, v, dout = (torch.randn(cu[-1], args.heads, args.head_dim, device=args.device,
                                 generator=g).to(args.dtype) for _ in range(4))
    panel = (f"{len(lengths)} documents, {cu[-1]} tokens, {args.heads} heads of "
             f"{args.head_dim}")
    record = {"title": "host and device time per call", "environment":
              common.environment("benchmarks.host_calls"),
              "settings": {"lengths": lengths, "heads": args.heads, "head_dim": args.head_dim,
                           "calls": args.calls, "dtype": str(args.dtype),
                           "kernel": args.kernel},
              "rows": []}
    for name, kernel, fn, checked in pieces(args, q, k, v, dout, cu):
        report = None
        try:
            host, device = timed(fn, args.calls, args.device)
            m = common.Measurement(median_ms=device / 1e3, iters=args.calls, warmup=2)
            if checked is not None:
                report = checked()
                m = check.judged(m, report)
        except Exception as e:  # noqa: BLE001 -- recorded
            m, host, device = common.failure(e), None, None
        ok = m.status == "ok"
        row = common.make_row(panel, name, cu[-1], m, 0.0, kernel=kernel,
                              host_us=host if ok else None, device_us=device if ok else None,
                              check=None if report is None else check.line(report))
        row["tflops"] = None
        record["rows"].append(row)
        said = (f"host {host:.1f} us, device {device:.1f} us per call" if ok
                else f"{m.status}: {m.error}")
        print(f"{name}: {said}" + (f", {row['check']}" if report else ""), flush=True)
    common.save(args.name, record, args, metrics=("host_us", "device_us"), bars=True)
    return 0 if all(r["status"] in ("ok", "unavailable") for r in record["rows"]) else 1


if __name__ == "__main__":
    common.run(main)
