"""Attention over a mesh of ranks: shard, run forward and backward, gather, compare.

    mpirun -np 4 python examples/context_parallel.py ring       # or head_parallel, allgather, ulysses
    torchrun --nproc-per-node 4 examples/context_parallel.py head_parallel

``ring`` splits the sequence (each rank keeps a load-balanced part of the tokens and K/V
blocks travel around the ring); ``head_parallel`` splits the heads (no communication).
On GPUs it uses NCCL and the fastest local kernel; on CPUs, gloo and the fp32 reference
kernel. Every rank builds the same full tensors (same seed), works on its own shard, and
checks the gathered output and gradients against attention on the full tensors.
"""

from __future__ import annotations

import sys

import torch

import schedules
import sdpa_fusion
from schedules.plan import mesh_names

NAMES = ("out", "dq", "dk", "dv")


def run(mesh, schedule_name: str, *, seq_len=None, heads=8, kv_heads=4, head_dim=64, causal=True,
        layout="bshe") -> dict[str, float]:
    """max |error| / max |reference| of out, dq, dk, dv under ``schedule_name``, the
    reference being attention on the full tensors on one device."""
    cuda = mesh.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seq_len = seq_len or (8192 if cuda else 64) * mesh.size()
    g = torch.Generator(device=mesh.device).manual_seed(0)

    def full(h):
        t = torch.randn(2, seq_len, h, head_dim, generator=g, device=mesh.device, dtype=dtype)
        return t.transpose(1, 2)  # a BSHE tensor: [B, S, H, E] in memory, [B, H, S, E] logically

    q, k, v, dout = full(heads), full(kv_heads), full(kv_heads), full(heads)
    sched = schedules.get(schedule_name, mesh)
    q_l, k_l, v_l = (sched.shard(t, layout=layout).requires_grad_() for t in (q, k, v))
    out_l = sdpa_fusion.attention(q_l, k_l, v_l, causal=causal, layout=layout, schedule=sched)
    out_l.backward(sched.shard(dout, layout=layout))
    got = [sched.unshard(t, layout=layout) for t in (out_l, q_l.grad, k_l.grad, v_l.grad)]

    q1, k1, v1 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out1 = sdpa_fusion.attention(q1, k1, v1, causal=causal, layout=layout)
    out1.backward(dout)
    want = (out1, q1.grad, k1.grad, v1.grad)
    return {name: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for name, a, b in zip(NAMES, got, want)}


def main(argv) -> int:
    name = argv[1] if len(argv) > 1 else "ring"
    mesh = sdpa_fusion.init_mesh((-1,), mesh_names(name, 1))
    errors = run(mesh, name)
    tolerance = 2e-2 if mesh.device.type == "cuda" else 1e-5  # bf16 on GPUs, fp32 on CPUs
    ok = all(e < tolerance for e in errors.values())
    if mesh.rank == 0:
        print(f"{name} over {mesh.size()} ranks on {mesh.device}, causal, batch 2: gathered "
              f"out and gradients vs attention on the full tensors on one device")
        print("  max |error| / max |reference|: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
              + f" ({'ok' if ok else 'ABOVE'} {tolerance:.0e})")
    sdpa_fusion.close_mesh()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
