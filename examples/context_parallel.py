"""Attention over a mesh of ranks: shard, run forward and backward, gather, compare.

    mpirun -np 4 python examples/context_parallel.py ring        # or allgather, ulysses, head_parallel
    torchrun --nproc-per-node 4 examples/context_parallel.py ulysses

On GPUs it uses NCCL and the fastest local kernel; on CPUs, gloo and the fp32 reference kernel.
Every rank builds the same full tensors (same seed), works on its own shard, and checks the
gathered result against attention on the full tensors.
"""

from __future__ import annotations

import sys

import torch

import schedules
import sdpa_fusion


def run(mesh, schedule_name: str, *, seq_len=None, heads=8, kv_heads=4, head_dim=64, causal=True,
        layout="bshe"):
    """Full-problem max errors (out, dq) of ``schedule_name`` against one-device attention."""
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
    out, dq = sched.unshard(out_l, layout=layout), sched.unshard(q_l.grad, layout=layout)

    q1, k1, v1 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out1 = sdpa_fusion.attention(q1, k1, v1, causal=causal, layout=layout)
    out1.backward(dout)
    return (out - out1).abs().max().item(), (dq - q1.grad).abs().max().item()


def main(argv) -> int:
    name = argv[1] if len(argv) > 1 else "ring"
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",))
    err_out, err_dq = run(mesh, name)
    if mesh.rank == 0:
        print(f"{name} over {mesh.size()} ranks on {mesh.device}: max |out - ref| = {err_out:.2e}, "
              f"max |dq - ref| = {err_dq:.2e}")
    sdpa_fusion.close_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
