"""Packed sequences (THD) over a mesh: load-balanced split with automatic padding, RoPE at the
positions the schedule gives, forward and backward, checked against one-device attention.

    mpirun -np 4 python examples/packed_thd.py ring        # or allgather, ulysses, head_parallel
    mpirun -np 4 python examples/packed_thd.py hybrid      # a 2 x 2 mesh: ulysses x ring
    torchrun --nproc-per-node 2 examples/packed_thd.py ulysses

Every rank holds the same GLOBAL packing (cu_seqlens of the full [T, H, E] tensors). Sequence
lengths here are not multiples of 2 x ranks, one is empty and one a single token: the
schedule pads each sequence's part for us. On CPUs it runs gloo and the fp32 reference kernel.
"""

from __future__ import annotations

import sys

import torch

import schedules
import sdpa_fusion
from sdpa_fusion.mesh import launch_env


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of x [T, H, E] at integer ``positions`` [T]."""
    e = x.shape[-1]
    inv = base ** (-torch.arange(0, e, 2, device=x.device, dtype=torch.float32) / e)
    angles = positions.float()[:, None] * inv
    cos, sin = (f(angles)[:, None, :].to(x.dtype) for f in (torch.cos, torch.sin))
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def run(mesh, schedule_name: str, *, lengths=(37, 1, 0, 200, 63), heads=8, kv_heads=4,
        head_dim=64, causal=True) -> dict:
    """Max errors of the sharded run against one-device attention, and what was checked."""
    cuda = mesh.device.type == "cuda"
    dtype, dev = (torch.bfloat16 if cuda else torch.float32), mesh.device
    lengths = [n * (64 if cuda else 1) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(int(cu[-1]), h, head_dim, generator=g, device=dev, dtype=dtype)
                     for h in (heads, kv_heads, kv_heads, heads))
    positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
    q_rot, k_rot = rope(q, positions), rope(k, positions)  # what one device computes

    sched = schedules.get(schedule_name, mesh)
    checked = {}
    if hasattr(sched, "pack"):  # a sequence schedule: shard first, RoPE at the local positions
        local = sched.pack(cu)
        q_l, k_l = (rope(local.shard(t), local.position_ids) for t in (q, k))
        v_l, packing = local.shard(v), local
        checked["rope"] = max((q_l - local.shard(q_rot)).abs().max().item(),
                              (k_l - local.shard(k_rot)).abs().max().item())
        checked["tokens"] = (local.tokens, int(cu[-1]))
    else:  # head_parallel: every rank keeps every token
        q_l, k_l, v_l = (sched.shard(t, layout="thd") for t in (q_rot, k_rot, v))
        packing = cu
    q_l, k_l, v_l = (t.detach().requires_grad_() for t in (q_l, k_l, v_l))
    out_l = sdpa_fusion.attention(q_l, k_l, v_l, causal=causal, schedule=sched, layout="thd",
                                  cu_seqlens=packing)
    kw = dict(layout="thd", cu_seqlens=cu)
    out_l.backward(sched.shard(dout, **kw))
    out, dq = sched.unshard(out_l, **kw), sched.unshard(q_l.grad, **kw)

    q1, k1, v1 = (t.detach().clone().requires_grad_() for t in (q_rot, k_rot, v))
    out1 = sdpa_fusion.attention(q1, k1, v1, causal=causal, layout="thd", cu_seqlens=cu)
    out1.backward(dout)
    checked["out"] = (out - out1).abs().max().item()
    checked["dq"] = (dq - q1.grad).abs().max().item()
    if "tokens" in checked:
        padding = local.token_index < 0
        checked["padding"] = max((t[padding].abs().max().item() if padding.any() else 0.0)
                                 for t in (out_l, q_l.grad, k_l.grad, v_l.grad))
    return checked


def mesh_for(schedule_name: str):
    """A 1-D mesh over all ranks; for "hybrid" a 2-D one, ("heads", "seq") of 2 x P/2 ranks
    (1 x P on an odd number)."""
    if schedule_name != "hybrid":
        return sdpa_fusion.init_mesh((-1,), ("seq",))
    env = launch_env()
    world = env.world_size if env else 1
    return sdpa_fusion.init_mesh((2 if world % 2 == 0 else 1, -1), ("heads", "seq"))


def main(argv) -> int:
    name = argv[1] if len(argv) > 1 else "ring"
    mesh = mesh_for(name)
    checked = run(mesh, name)
    if mesh.rank == 0:
        shape = " x ".join(map(str, mesh.shape))
        print(f"{name} over {shape} ranks on {mesh.device}, packed sequences (causal):")
        print(f"  max |out - one device| = {checked['out']:.2e}, max |dq - one device| = "
              f"{checked['dq']:.2e}")
        if "tokens" in checked:
            local, total = checked["tokens"]
            print(f"  {local} local tokens per rank (padding included) of {total}; padding "
                  f"outputs and gradients max |.| = {checked['padding']:.1e}")
            print(f"  RoPE at local.position_ids vs RoPE before sharding: max diff "
                  f"{checked['rope']:.1e}")
    sdpa_fusion.close_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
