"""Video tokens split over ranks in intact 3-D tiles, with 3-D RoPE at each token's
(frame, row, column): a clip's attention as a video model runs it.

    mpirun -np 4 python examples/video_tiles.py ring      # or ulysses, allgather; 1, 2, 4 or 8 ranks

A clip of F frames of H x W tokens, in raster order (frame, row, column), is one sequence of
F*H*W tokens. ``VideoTiles(frame=(H, W), tiles=(tf, th, tw))`` gives rank r one intact box
of (F/tf) x (H/th) x (W/tw) tokens; ``coordinates`` of the positions the schedule gives each
rank are the (f, h, w) that 3-D RoPE rotates by (a third of the head dim per axis). Every
rank rotates only its own tokens, runs bidirectional attention under the schedule, and the
gathered output and gradients are checked against one device rotating and attending the
whole clip.
"""

from __future__ import annotations

import sys

import torch

import schedules
import sdpa_fusion
from schedules.partition import VideoTiles

try:
    from examples.packed_thd import rope
except ImportError:  # run as a script: examples/ itself is on sys.path
    from packed_thd import rope

FRAME = (4, 4)  # rows, columns of tokens per frame
TILES = {1: (1, 1, 1), 2: (1, 1, 2), 4: (1, 2, 2), 8: (2, 2, 2)}  # (tf, th, tw) per rank count


def rope_3d(x: torch.Tensor, coordinates: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, E] rotated by RoPE at (f, h, w) ``coordinates`` [S, 3], one third of E per
    axis."""
    parts = x.transpose(1, 2).chunk(3, dim=-1)  # [B, S, H, E/3] each
    rotated = [rope(p, coordinates[:, axis]) for axis, p in enumerate(parts)]
    return torch.cat(rotated, dim=-1).transpose(1, 2)


def tiles_for(ranks: int) -> tuple[int, int, int]:
    if ranks not in TILES:
        raise ValueError(f"this example splits a {FRAME[0]}x{FRAME[1]} frame for 1, 2, 4 or 8 "
                         f"ranks, not {ranks}")
    return TILES[ranks]


def run(mesh, schedule_name: str, *, frames=4, heads=4, head_dim=48) -> dict:
    """What was checked: max |error| / max |reference| of out, dq, dk, dv; the local RoPE
    against RoPE before sharding; whether every rank's tokens form one intact box."""
    cuda = mesh.device.type == "cuda"
    dtype, dev = (torch.bfloat16 if cuda else torch.float32), mesh.device
    frames = frames * (64 if cuda else 1)
    tiles = tiles_for(mesh.size())
    partition = VideoTiles(FRAME, tiles)
    seq = frames * FRAME[0] * FRAME[1]
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(1, seq, heads, head_dim, generator=g, device=dev, dtype=dtype)
                     .transpose(1, 2) for _ in range(4))  # BSHE, as rope_3d returns them
    everywhere = partition.coordinates(torch.arange(seq, device=dev))

    sched = schedules.get(schedule_name, mesh, partition=partition)
    mine = sched.indices(seq).to(dev)  # this rank's token positions, in its local order
    here = partition.coordinates(mine)
    q_l, k_l, v_l = (sched.shard(t, layout="bshe").requires_grad_() for t in (q, k, v))
    out_l = sdpa_fusion.attention(rope_3d(q_l, here), rope_3d(k_l, here), v_l, schedule=sched,
                                  layout="bshe")
    out_l.backward(sched.shard(dout, layout="bshe"))
    got = [sched.unshard(t, layout="bshe") for t in (out_l, q_l.grad, k_l.grad, v_l.grad)]

    q1, k1, v1 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out1 = sdpa_fusion.attention(rope_3d(q1, everywhere), rope_3d(k1, everywhere), v1,
                                 layout="bshe")
    out1.backward(dout)
    want = (out1, q1.grad, k1.grad, v1.grad)
    checked = {name: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
               for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    checked["rope"] = (rope_3d(q_l, here) - sched.shard(rope_3d(q, everywhere), layout="bshe")
                       ).abs().max().item()
    box = [frames // tiles[0], FRAME[0] // tiles[1], FRAME[1] // tiles[2]]
    spans = (here.max(0).values - here.min(0).values + 1).tolist()
    checked["intact tile"] = spans == box and len(mine) == box[0] * box[1] * box[2]
    checked["tile"] = (here.min(0).values.tolist(), box)
    return checked


def main(argv) -> int:
    name = argv[1] if len(argv) > 1 else "ring"
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",))
    checked = run(mesh, name)
    tolerance = 2e-2 if mesh.device.type == "cuda" else 1e-5
    ok = checked["intact tile"] and checked["rope"] == 0.0 and all(
        checked[n] < tolerance for n in ("out", "dq", "dk", "dv"))
    corner, box = checked["tile"]
    print(f"rank {mesh.rank}: tokens of the box at (f, h, w) = {tuple(corner)}, "
          f"{'x'.join(map(str, box))} tokens, intact: {checked['intact tile']}", flush=True)
    if mesh.rank == 0:
        print(f"{name} over {mesh.size()} ranks, tiles {tiles_for(mesh.size())} of {FRAME[0]}x"
              f"{FRAME[1]} frames, 3-D RoPE at each rank's own (f, h, w):")
        print(f"  RoPE on the ranks vs before sharding: max diff {checked['rope']:.1e}")
        print("  max |error| / max |one device|: " + ", ".join(
            f"{n} {checked[n]:.1e}" for n in ("out", "dq", "dk", "dv"))
            + f" ({'ok' if ok else 'FAILED'}, tolerance {tolerance:.0e})")
    sdpa_fusion.close_mesh()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
