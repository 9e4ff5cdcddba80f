"""The core's command line: ``python -m sdpa_fusion demo | explain``, on one device.

    python -m sdpa_fusion demo            # definitions + a checked fwd/bwd run
    python -m sdpa_fusion explain --seq 8192 --heads 32 --kv-heads 8 --layout bshe --causal

``demo`` checks forward and backward against torch SDPA (the reference kernel on a CPU; on a
GPU ``nvfuser`` and ``auto``, with TFLOP/s). ``schedules.cli`` adds meshes. A user's mistake
is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from .spec import AttentionSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Largest |error| / max |oracle| accepted by ``demo`` (an fp32 oracle on GPUs, fp64 on CPUs)
RELATIVE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
CPU_SHAPE = dict(batch=2, heads=8, kv_heads=2, seq=256, head_dim=64)
GPU_SHAPE = dict(batch=2, heads=16, kv_heads=16, seq=4096, head_dim=128)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (and exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _window(text: str) -> tuple[int, int | None]:
    """``LEFT`` or ``LEFT,RIGHT`` (token counts) as a (left, right) window; RIGHT: unbounded."""
    parts = text.split(",")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not LEFT or LEFT,RIGHT (non-negative token counts), e.g. 4096 or 256,256")
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (int(parts[0]), None)


def _add_problem_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("problem (defaults depend on the device)")
    g.add_argument("--batch", type=_positive)
    g.add_argument("--heads", type=_positive, help="query heads")
    g.add_argument("--kv-heads", type=_positive, help="key/value heads (fewer than --heads: GQA)")
    g.add_argument("--seq", type=_positive, help="query length (and key length unless --kv-seq)")
    g.add_argument("--kv-seq", type=_positive, help="key/value length")
    g.add_argument("--head-dim", type=_positive)
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    g.add_argument("--layout", choices=["bhse", "bshe"], default="bshe")
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scale", type=float, help="softmax scale (default 1/sqrt(head_dim))")
    g.add_argument("--window", type=_window, metavar="LEFT[,RIGHT]",
                   help="sliding window: keys each query sees before it (and after it)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def build_parser(prog: str = "python -m sdpa_fusion",
                 extend_explain=None) -> argparse.ArgumentParser:
    """The parser of ``demo`` and ``explain``; ``extend_explain(parser)`` adds to ``explain``."""
    parser = _Parser(prog=prog, description="Scaled-dot-product attention as nvFuser fusions, "
                                            "over device meshes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,explain}")
    demo = sub.add_parser("demo", help="print the fusion definitions and run a checked fwd+bwd")
    _add_problem_args(demo)
    demo.add_argument("--kernels", help="comma-separated kernels to run (default: nvfuser,auto "
                                        "on a GPU, reference on a CPU)")
    demo.add_argument("--iters", type=_positive, default=20, help="timed iterations on a GPU")
    explain = sub.add_parser("explain", help="print the plan attention() would run for a shape")
    _add_problem_args(explain)
    explain.add_argument("--kernel", default="auto",
                         help="auto, cudnn, fa4, flash, nvfuser, reference")
    if extend_explain is not None:
        extend_explain(explain)
    return parser


def device_of(name: str) -> torch.device:
    """The device ``--device`` names (``auto``: a GPU when torch sees one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    return torch.device(name)


def spec_from_args(args: argparse.Namespace, device: torch.device,
                   defaults: dict | None = None) -> AttentionSpec:
    """The AttentionSpec the flags describe, the others from ``defaults`` (those of ``device``)."""
    d = defaults or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)

    def given(value, default):
        return default if value is None else value

    heads = given(args.heads, d["heads"])
    seq = given(args.seq, d["seq"])
    return AttentionSpec(
        batch=given(args.batch, d["batch"]), heads=heads,
        kv_heads=given(args.kv_heads, d["kv_heads"] if args.heads is None else heads),
        q_len=seq, kv_len=given(args.kv_seq, seq), head_dim=given(args.head_dim, d["head_dim"]),
        dtype=DTYPES[args.dtype], causal=args.causal, scale=args.scale, layout=args.layout,
        window=getattr(args, "window", None),
    ).validate()


def make_inputs(spec: AttentionSpec, device, *, generator=None, empty=False):
    """q, k, v (and dout) in the spec's layout, standard normal unless ``empty``."""
    q_shape = (spec.batch, spec.heads, spec.q_len, spec.head_dim)
    kv_shape = (spec.batch, spec.kv_heads, spec.kv_len, spec.head_dim)
    tensors = []
    for shape in (q_shape, kv_shape, kv_shape, q_shape):
        t = spec.layout.empty(shape, dtype=spec.dtype, device=device)
        if not empty:
            t.copy_(torch.randn(shape, generator=generator, device=device, dtype=torch.float32))
        tensors.append(t)
    return tensors


def spec_text(spec: AttentionSpec) -> str:
    """A spec in one short line: b=2 h=16 h_kv=4 s_q=4096 s_kv=4096 e=128 bfloat16 bshe causal."""
    s = (f"b={spec.batch} h={spec.heads} h_kv={spec.kv_heads} s_q={spec.q_len} "
         f"s_kv={spec.kv_len} e={spec.head_dim} {str(spec.dtype).replace('torch.', '')} "
         f"{spec.layout}")
    s += " causal" if spec.causal else ""
    if spec.window is not None:
        s += f" window ({spec.window.left}, {spec.window.right})"
    return s


def print_definitions(spec: AttentionSpec) -> None:
    """Print the nvFuser fusion definitions of ``spec``."""
    try:
        from . import definitions
    except ImportError as e:  # the definitions need nvfuser_direct
        print(f"--- nvFuser fusion definitions: cannot import them here ({e})")
        return
    for name in ("SdpaForward", "SdpaBackward"):
        print(f"--- {name}({spec_text(spec)})")
        try:
            print(getattr(definitions, name)(spec))
        except (ImportError, RuntimeError, ValueError) as e:
            print(f"    (cannot build it here: {type(e).__name__}: {e})")


def torch_oracle(spec: AttentionSpec, q, k, v, dout, dtype):
    """out, dq, dk, dv of torch SDPA on ``dtype`` copies (explicit top-left causal mask)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    ke, ve = (t.repeat_interleave(spec.groups, dim=1) for t in leaves[1:])
    mask = None
    if spec.causal:
        i = torch.arange(spec.q_len, device=q.device).unsqueeze(1)
        mask = torch.arange(spec.kv_len, device=q.device).unsqueeze(0) <= i
    out = F.scaled_dot_product_attention(leaves[0], ke, ve, attn_mask=mask, scale=spec.scale)
    out.backward(dout.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _options(spec: AttentionSpec, kernel: str) -> dict:
    return dict(causal=spec.causal, scale=spec.scale, layout=spec.layout, kernel=kernel)


def run_attention(spec: AttentionSpec, kernel: str, q, k, v, dout):
    """out, dq, dk, dv of ``sdpa_fusion.attention`` with ``kernel``."""
    import sdpa_fusion

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*leaves, **_options(spec, kernel))
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def compare(results, oracle, dtype) -> bool:
    """Print max |error| of out, dq, dk, dv against the oracle; True when all are in tolerance."""
    ok = True
    for name, got, want in zip(("out", "dq", "dk", "dv"), results, oracle):
        err = (got.double() - want.double()).abs().max().item()
        rel = err / max(want.double().abs().max().item(), 1e-30)
        good = rel <= RELATIVE_TOLERANCE[dtype]
        ok &= good
        print(f"    {name}: max |error| {err:.3e}  (relative {rel:.2e}) {'ok' if good else 'TOO LARGE'}")
    return ok


def _time(fn, iters: int) -> float:
    """Seconds per call of ``fn`` on the GPU (CUDA events, after two warm-up calls)."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def demo(args: argparse.Namespace) -> int:
    import sdpa_fusion
    from .kernels import KernelUnavailable, names

    device = device_of(args.device)
    spec = spec_from_args(args, device)
    kernels = ("reference",) if device.type == "cpu" else ("nvfuser", "auto")
    if args.kernels:
        kernels = tuple(name.strip() for name in args.kernels.split(",") if name.strip())
        unknown = [name for name in kernels if name not in names()]
        if unknown:
            raise ValueError(f"--kernels {','.join(unknown)}: not known; choose among {names()}")
    print(f"sdpa-fusion demo on {device}: {spec_text(spec)}")
    print(f"FLOPs: forward {spec.flops():.3e}, forward+backward {spec.flops(backward=True):.3e}")
    print_definitions(spec)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = make_inputs(spec, device, generator=generator)
    oracle_dtype = torch.float64 if device.type == "cpu" else torch.float32
    oracle = torch_oracle(spec, q, k, v, dout, oracle_dtype)
    ok = True
    for kernel in kernels:
        print(f"--- kernel={kernel!r} against torch SDPA in {str(oracle_dtype).replace('torch.', '')}")
        try:
            plan = sdpa_fusion.explain(q, k, v, **_options(spec, kernel))
            if kernel == "auto":
                print(f"    auto chose {plan.kernel.name!r}")
            results = run_attention(spec, kernel, q, k, v, dout)
        except (KernelUnavailable, NotImplementedError) as e:
            print(f"    not run: {type(e).__name__}: {e or 'not implemented yet'}")
            continue
        ok &= compare(results, oracle, spec.dtype)
        if device.type == "cuda":
            _report_speed(spec, kernel, q, k, v, dout, args.iters)
    print("demo: all checks passed" if ok else "demo: some results are outside tolerance")
    return 0 if ok else 1


def _report_speed(spec, kernel, q, k, v, dout, iters) -> None:
    import sdpa_fusion

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward():
        with torch.no_grad():
            sdpa_fusion.attention(*leaves, **_options(spec, kernel))

    def forward_backward():
        sdpa_fusion.attention(*leaves, **_options(spec, kernel)).backward(dout)

    for name, fn, flops in (("forward", forward, spec.flops()),
                            ("forward+backward", forward_backward, spec.flops(backward=True))):
        seconds = _time(fn, iters)
        print(f"    {name}: {seconds * 1e3:.3f} ms, {flops / seconds / 1e12:.1f} TFLOP/s")


def explain(args: argparse.Namespace) -> int:
    """Print what ``attention`` would run on one device for the problem of ``args``."""
    import sdpa_fusion

    device = device_of(args.device)
    spec = spec_from_args(args, device)
    q, k, v, _ = make_inputs(spec, device, empty=True)
    print(sdpa_fusion.explain(q, k, v, window=spec.window, **_options(spec, args.kernel)))
    print(f"FLOPs: forward {spec.flops():.3e}, forward+backward {spec.flops(backward=True):.3e}")
    return 0


def run(parser: argparse.ArgumentParser, commands: dict, argv: list[str] | None = None) -> int:
    """Parse ``argv`` with ``parser`` and run its command from ``commands`` (name -> function)."""
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    try:
        rc = commands[args.command](args)
    except ValueError as e:  # a user's mistake: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "demo":
        print(f"({time.perf_counter() - start:.1f} s)")
    return rc


def main(argv: list[str] | None = None, prog: str = "python -m sdpa_fusion") -> int:
    return run(build_parser(prog), {"demo": demo, "explain": explain}, argv)
