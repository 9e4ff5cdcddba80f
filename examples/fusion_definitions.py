"""Attention as nvFuser fusion definitions on one device: define them, print them, run them.

    python examples/fusion_definitions.py

Builds ``SdpaForward``, ``SdpaBackward``, ``SdpaForwardBackward`` and ``LseMerge`` for a
small causal grouped-query problem (8 query heads, 2 K/V heads) in the BSHE layout and prints
each (the print is a script that rebuilds the fusion). On a GPU it executes them and checks
every output against torch SDPA (fp32): out and lse of the forward, dq, dk, dv of the
backward, the fused forward+backward, and ``LseMerge`` joining attention over the two halves
of the keys. Without a GPU nvFuser defines but cannot execute; the same checks then run the
fp32 reference kernel (what CPU ranks run) and the torch merge in its place.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import sdpa_fusion
from sdpa_fusion.kernels.reference import ReferenceKernel
from sdpa_fusion.merge import merge_partial


def oracle(q, k, v, dout, causal: bool):
    """out, lse, dq, dk, dv of torch SDPA in fp64 (top-left causal mask, GQA by repetition)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qd, kd, vd = leaves
    groups = q.shape[1] // k.shape[1]
    kx, vx = (t.repeat_interleave(groups, dim=1) for t in (kd, vd))
    scores = qd @ kx.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        s_q, s_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(s_q, s_k, dtype=torch.bool).triu(1).to(q.device),
                                    float("-inf"))
    out = F.scaled_dot_product_attention(qd, kx, vx, is_causal=causal)
    out.backward(dout.double())
    return [out.detach(), scores.logsumexp(-1).detach()] + [t.grad for t in leaves]


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def inputs(spec: sdpa_fusion.AttentionSpec, device, generator):
    """q, k, v, dout in the spec's layout."""
    def rand(heads):
        shape = (spec.batch, heads, spec.q_len, spec.head_dim)
        t = torch.randn(shape, generator=generator, device=device).to(spec.dtype)
        return spec.layout.to(t)

    return rand(spec.heads), rand(spec.kv_heads), rand(spec.kv_heads), rand(spec.heads)


def run(device=None, *, show=print) -> dict:
    """Build and print the definitions; execute them on a GPU, else check the reference
    kernel. Returns the relative error of every checked output and whether fusions ran."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    spec = sdpa_fusion.AttentionSpec(batch=2, heads=8, kv_heads=2, q_len=256, kv_len=256,
                                     head_dim=64, causal=True, layout="bshe")  # bf16
    half = spec.replace(kv_len=spec.kv_len // 2, causal=False)
    definitions = {
        "SdpaForward": sdpa_fusion.SdpaForward(spec),
        "SdpaBackward": sdpa_fusion.SdpaBackward(spec),
        "SdpaForwardBackward": sdpa_fusion.SdpaForwardBackward(spec),
        "SdpaForward (half the keys, no mask)": sdpa_fusion.SdpaForward(half),
        "LseMerge": sdpa_fusion.LseMerge(spec.heads, spec.head_dim, layout=spec.layout,
                                         block_dtype=spec.dtype),
    }
    for name, fd in definitions.items():
        show(f"--- {name}\n{fd}")
    q, k, v, dout = inputs(spec, device, torch.Generator(device=device).manual_seed(0))
    if not gpu:  # the reference kernel computes in fp32: give it the same values in fp32
        q, k, v, dout = (spec.layout.to(t.float()) for t in (q, k, v, dout))
    want = dict(zip(("out", "lse", "dq", "dk", "dv"), oracle(q, k, v, dout, causal=True)))
    # the two halves of the keys, each a dense tensor in the spec's layout
    kv_halves = [tuple(spec.layout.to(t) for t in kv)
                 for kv in zip(k.chunk(2, dim=2), v.chunk(2, dim=2))]
    checked = {}
    if gpu:
        out, lse = definitions["SdpaForward"].execute([q, k, v])
        seed = torch.zeros(2, dtype=torch.uint64, device=device)
        offset = torch.zeros((), dtype=torch.uint64, device=device)
        dq, dk, dv = definitions["SdpaBackward"].execute([dout, q, k, v, out, lse, seed, offset])
        fused = definitions["SdpaForwardBackward"].execute([q, k, v, dout])
        checked.update({f"fused {n}": error(t, want[n])
                        for n, t in zip(("out", "lse", "dq", "dk", "dv"), fused)})
        halves = [definitions["SdpaForward (half the keys, no mask)"].execute([q, *kv])
                  for kv in kv_halves]
        (out_a, lse_a), (out_b, lse_b) = halves  # LseMerge folds a block into fp32 sums
        merged, _ = definitions["LseMerge"].execute([out_a.float(), lse_a, out_b, lse_b])
    else:
        kernel, scale = ReferenceKernel(), spec.softmax_scale
        out, lse = kernel.forward(q, k, v, causal=True, scale=scale)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=scale)
        halves = [kernel.forward(q, *kv, causal=False, scale=scale) for kv in kv_halves]
        merged, _ = merge_partial(*halves[0], *halves[1])
    checked.update({name: error(t, want[name])
                    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv))})
    checked["merged halves"] = error(merged, oracle(q, k, v, dout, causal=False)[0])
    return {"executed fusions": gpu, "errors": checked, "dtype": q.dtype}


TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def main() -> int:
    result = run()
    where = "executed on the GPU" if result["executed fusions"] else \
        "defined only (no GPU: nvFuser cannot execute); the reference kernel checked instead"
    print(f"\nfusions {where}; max |error| / max |torch SDPA in fp64|:")
    ok = True
    for name, err in result["errors"].items():
        good = err < TOLERANCE[result["dtype"]]
        ok &= good
        print(f"  {name:>14}: {err:.1e} {'ok' if good else 'TOO LARGE'}")
    print("all checks passed" if ok else "some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
