"""Packed and custom partitions under mpirun: shard/unshard, video tiles, and bad input raised
on every rank (positions for RoPE, planned per rank: tests/test_plans.py).

    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_thd_partitions.py
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from schedules.partition import VideoTiles

from .conftest import assert_matches, make_problem, run_schedule
from .packed import (assert_packed_matches, assert_round_trip, global_positions, make_packed,
                     run_packed)


def test_shard_unshard_round_trip_is_differentiable(mesh):
    """unshard(shard(x)) is x (zero in the global padding slots); the gradient of the full
    result reaches the tokens this rank holds (as for dense unshard), padding gets none."""
    p = mesh.size()
    problem = make_packed([3 * p + 1, 1, 0, 2], h=2, slack=[1, 0, 2, 0])
    sched = schedules.get("ring", mesh)
    assert_round_trip(sched, problem)


@pytest.mark.parametrize("name, causal", [("ring", False), ("allgather", False), ("ulysses", True)])
def test_index_map_per_packed_sequence(mesh, name, causal):
    """An index map places the tokens of every packed sequence (each of the map's length)."""
    p = mesh.size()
    rows = torch.randperm(4 * p, generator=torch.Generator().manual_seed(5)).view(p, -1).tolist()
    problem = make_packed([4 * p, 4 * p, 4 * p], h=2 * p, h_kv=p, causal=causal)
    sched = schedules.get(name, mesh, partition=rows)
    assert_packed_matches(problem, run_packed(sched, problem))


# ---- video tiles -------------------------------------------------------------------------

def tiles_for(p: int) -> tuple[int, int, int]:
    return {1: (1, 1, 1), 2: (1, 1, 2), 3: (3, 1, 1), 4: (1, 2, 2), 8: (2, 2, 2)}[p]


@pytest.mark.parametrize("name, causal", [("ring", False), ("allgather", False), ("ulysses", False),
                                          ("ulysses", True)])
def test_video_tiles_dense(mesh, name, causal):
    """One video of F x 4 x 4 tokens per sample; every rank keeps an intact tile."""
    p = mesh.size()
    tiles = VideoTiles(frame=(4, 4), tiles=tiles_for(p))
    problem = make_problem(b=2, h=2 * p, h_kv=p, s=2 * tiles.tiles[0] * 16, e=8, layout="bshe",
                           causal=causal)
    sched = schedules.get(name, mesh, partition=tiles)
    assert_matches(problem, run_schedule(sched, problem))
    coords = tiles.coordinates(sched.position_ids(problem.q.shape[2]))
    sizes = [int(c.max() - c.min() + 1) for c in coords.unbind(1)]
    assert sizes[0] * sizes[1] * sizes[2] == len(coords)  # an intact box


@pytest.mark.parametrize("name, causal", [("ring", False), ("allgather", False), ("ulysses", True)])
def test_video_tiles_packed(mesh, name, causal):
    """Packed videos of different lengths, each tiled; coordinates for 3-D RoPE."""
    p = mesh.size()
    tiles = VideoTiles(frame=(2, 4), tiles=tiles_for(p))
    frames = tiles.tiles[0]
    problem = make_packed([8 * frames, 16 * frames], h=2 * p, h_kv=p, causal=causal)
    sched = schedules.get(name, mesh, partition=tiles)
    assert_packed_matches(problem, run_packed(sched, problem))
    local = sched.pack(problem.cu_seqlens)
    coords = tiles.coordinates(global_positions(problem))
    assert torch.equal(local.coordinates, local.shard(coords))


def test_video_tiles_causal_refused_by_ring(mesh):
    p = mesh.size()
    sched = schedules.get("ring", mesh, partition=VideoTiles(frame=(4, 4), tiles=tiles_for(p)))
    problem = make_packed([16 * sched.partition.tiles[0]], h=2 * p, causal=True)
    with pytest.raises(ValueError, match=r"takes partition 'load_balanced', 'contiguous' or "
                                         r"'striped', not 'video_tiles'.*schedule 'ulysses'"):
        run_packed(sched, problem)


@pytest.mark.usefixtures("several_ranks")
def test_video_tiles_causal_under_allgather(mesh):
    """Exact when every rank's tile is at most two runs of tokens (whole frames), refused
    when it is more (columns of every row)."""
    p = mesh.size()
    frames = VideoTiles(frame=(2, 2), tiles=(p, 1, 1))
    problem = make_packed([8 * p, 4 * p], h=2, causal=True)
    sched = schedules.get("allgather", mesh, partition=frames)
    assert_packed_matches(problem, run_packed(sched, problem))
    columns = VideoTiles(frame=(2, 8), tiles=(1, 1, p))
    with pytest.raises(ValueError, match=r"partition 'video_tiles' gives a rank 4 runs of a "
                                         r"sequence's part"):
        sched = schedules.get("allgather", mesh, partition=columns)
        run_packed(sched, make_packed([32], h=2, causal=True))


# ---- bad input, raised on every rank -----------------------------------------------------

def _attention(sched, q, k, v, **kw):
    return sdpa_fusion.attention(q, k, v, layout="thd", kernel="reference", schedule=sched, **kw)


def _local(sched, problem):
    local = sched.pack(problem.cu_seqlens)
    return local, [local.shard(t) for t in (problem.q, problem.k, problem.v)]


@pytest.mark.usefixtures("several_ranks")
def test_cu_seqlens_differing_on_one_rank(mesh):
    """Rank 0 packs [4P, 12P] where the others pack [8P, 8P] (same local size): every rank
    raises, then a correct call runs."""
    p = mesh.size()
    good = make_packed([8 * p, 8 * p], h=2)
    sched = schedules.get("ring", mesh)
    cu = torch.tensor([0, 4 * p, 16 * p], dtype=torch.int32) if mesh.rank == 0 else good.cu_seqlens
    local = sched.pack(cu)
    q, k, v = (local.shard(t) for t in (good.q, good.k, good.v))
    shown = rf"cu_seqlens \(\(0, {4 * p}, {16 * p}\) on rank 0 / \(0, {8 * p}, {16 * p}\) on"
    with pytest.raises(ValueError, match=rf"needs the same call on every rank .* differ in {shown}"):
        _attention(sched, q, k, v, cu_seqlens=cu)
    assert_packed_matches(good, run_packed(sched, good))


@pytest.mark.usefixtures("several_ranks")
def test_local_packing_of_another_rank(mesh):
    p = mesh.size()
    problem = make_packed([3 * p, 5], h=2)
    sched = schedules.get("ring", mesh, partition="load_balanced")
    local, (q, k, v) = _local(sched, problem)
    if mesh.rank == 0:
        local = sched.pack(problem.cu_seqlens, rank=1)
    with pytest.raises(ValueError, match=r"rank 0: cu_seqlens is LocalPacking\(rank 1 of .*not "
                                         r"this rank's part under schedule 'ring' \(rank 0 of"):
        _attention(sched, q, k, v, cu_seqlens=local)
    assert_packed_matches(problem, run_packed(sched, problem, local=True))


@pytest.mark.usefixtures("several_ranks")
def test_local_tokens_mismatch(mesh):
    """Rank 0 passes its full tensors with the global cu_seqlens: the error names the fix."""
    p = mesh.size()
    problem = make_packed([3 * p, 5], h=2)
    sched = schedules.get("ring", mesh, partition="load_balanced")
    local, (q, k, v) = _local(sched, problem)
    if mesh.rank == 0:
        q, k, v = problem.q, problem.k, problem.v
    fix = r"shard q, k, v with schedule.shard\(t, layout='thd', cu_seqlens=cu_seqlens\)"
    with pytest.raises(ValueError, match=rf"q has {problem.q.shape[0]} tokens but this rank's "
                                         rf"part of the packing has {local.tokens} .* {fix}"):
        _attention(sched, q, k, v, cu_seqlens=problem.cu_seqlens)
    assert_packed_matches(problem, run_packed(sched, problem))


def test_local_packing_misuse(mesh):
    p = mesh.size()
    problem = make_packed([3 * p, 5], h=2 * p)
    ring = schedules.get("ring", mesh)
    local, (q, k, v) = _local(ring, problem)
    with pytest.raises(ValueError, match="a LocalPacking already holds the padding"):
        _attention(ring, q, k, v, cu_seqlens=local, cu_seqlens_padded=problem.cu_seqlens)
    with pytest.raises(ValueError, match="not this rank's part under schedule 'ring'.* striped"):
        _attention(schedules.get("ring", mesh, partition="striped"), q, k, v, cu_seqlens=local)
    heads = schedules.get("head_parallel", mesh)
    q, k, v = (heads.shard(t, layout="thd") for t in (problem.q, problem.k, problem.v))
    with pytest.raises(ValueError, match="schedule 'head_parallel' does not split tokens; pass the "
                                         "global cu_seqlens"):
        _attention(heads, q, k, v, cu_seqlens=local)
    with pytest.raises(ValueError, match=r"t \(\[5, 2, 8\]\) must have .* tokens along dim 0"):
        local.shard(problem.q[:5, :2])


@pytest.mark.usefixtures("several_ranks")
def test_allgather_causal_striped_refused(mesh):
    p = mesh.size()
    problem = make_packed([4 * p + 2], h=2, causal=True)
    with pytest.raises(ValueError, match=r"partition 'striped' gives a rank \d+ runs of a "
                                         r"sequence's part over"):
        run_packed(schedules.get("allgather", mesh, partition="striped"), problem)
