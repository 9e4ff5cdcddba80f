"""hybrid schedule on 2-D meshes vs the reference (tests/reference.py) and the 1-D schedules,
and its errors (its describe() against the formulas: tests/test_describe.py; the bytes each
dim moves: test_traffic.py).

    mpirun -np 2 python -m pytest tests/distributed/test_hybrid.py                   # 1x2, 2x1
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_hybrid.py   # 2x2
    mpirun -np 8 --oversubscribe python -m pytest tests/distributed/test_hybrid.py   # 2x4, 4x2

Mesh shapes are (inner, outer) = ("heads", "seq") sizes; 1xP and Px1 are also checked to
equal the 1-D schedules over all ranks.
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from schedules.hybrid import Hybrid
from sdpa_fusion.kernels.reference import ReferenceKernel
from sdpa_fusion.layout import has_layout
from sdpa_fusion.mesh import launch_env

from .conftest import assert_matches, make_problem, run_schedule
from .packed import (assert_packed_matches, global_positions, make_packed, run_packed,
                     sequences)

INNERS = ["ulysses", "head_parallel"]
OUTERS = ["ring", "allgather"]


def mesh_shapes(world: int) -> list[tuple[int, int]]:
    """The 2-D shapes tested on ``world`` ranks: 1xP and Px1 for a prime P, else the two
    most even factorizations."""
    if world == 1:
        return [(1, 1)]
    a = next(d for d in range(2, world + 1) if world % d == 0)
    if a == world:
        return [(1, world), (world, 1)]
    return sorted({(a, world // a), (world // a, a)})


_env = launch_env()
SHAPES = mesh_shapes(_env.world_size if _env else 1)
shapes = pytest.mark.parametrize("shape", SHAPES, ids=[f"{i}x{o}" for i, o in SHAPES])


@pytest.fixture(scope="module")
def meshes(mesh):
    """``meshes(shape, names)``: a 2-D mesh over all ranks, made once per shape and names."""
    made = {}

    def get(shape, names=("heads", "seq")):
        if (shape, names) not in made:
            made[(shape, names)] = sdpa_fusion.init_mesh(shape, names)
        return made[(shape, names)]

    return get


def problem_for(shape, *, kv="gqa", **kwargs):
    """A problem every mesh of ``shape`` can split: 2 query heads per inner rank, 4 tokens
    per rank; ``kv``: "mha", "gqa" (2 query heads per K/V head) or "fewer" (one K/V head)."""
    pi, po = shape
    h = 2 * pi
    h_kv = {"mha": h, "gqa": pi, "fewer": 1}[kv]
    return make_problem(**{"h": h, "h_kv": h_kv, "b": 1, "s": 4 * pi * po, "e": 8,
                            "scale": 0.3, **kwargs})


def run_with_copies(sched, problem):
    """``run_schedule``, but K/V gradients unsharded as the sums of their copies (K/V with
    fewer heads than inner ranks)."""
    layout = problem.layout
    q, k, v = (sched.shard(t, layout=layout).requires_grad_() for t in (problem.q, problem.k, problem.v))
    out = sdpa_fusion.attention(q, k, v, causal=problem.causal, scale=problem.scale, layout=layout,
                                kernel="reference", schedule=sched)
    out.backward(sched.shard(problem.dout, layout=layout))
    assert all(has_layout(t, layout) for t in (out, q.grad, k.grad, v.grad))
    heads = problem.k.shape[1]
    return (sched.unshard(out, layout=layout), sched.unshard(q.grad, layout=layout),
            *(sched.unshard(g, layout=layout, heads=heads, copies="sum") for g in (k.grad, v.grad)))


# ---- results ----------------------------------------------------------------------------
@shapes
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("outer", OUTERS)
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference(meshes, shape, inner, outer, layout, causal):
    problem = problem_for(shape, layout=layout, causal=causal)
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer=outer)
    assert (sched.inner.size, sched.outer.size) == shape
    assert_matches(problem, run_schedule(sched, problem))


@shapes
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("outer", OUTERS)
@pytest.mark.parametrize("kv", ["mha", "fewer"])
def test_kv_heads(meshes, shape, inner, outer, kv):
    """All heads, and one K/V head for all query heads (replicated over the inner ranks)."""
    problem = problem_for(shape, kv=kv, b=2, layout="bshe", causal=True)
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer=outer)
    assert_matches(problem, run_with_copies(sched, problem))


def index_map(s: int, p: int, causal: bool):
    """Non-causal: a random permutation in rows. Causal: rank r holds chunks r and r + P of
    2P, increasing (two runs of tokens: what allgather can mask; ring refuses index maps)."""
    if causal:
        c = s // (2 * p)
        return [list(range(r * c, (r + 1) * c)) + list(range((r + p) * c, (r + p + 1) * c))
                for r in range(p)]
    return torch.randperm(s, generator=torch.Generator().manual_seed(5)).view(p, -1).tolist()


def refusal(outer: str, partition: str, causal: bool, po: int) -> str | None:
    """What the outer schedule says when it cannot mask ``partition`` (None: it can)."""
    if causal and outer == "ring" and partition == "index_map":
        return "ring attention with causal=True takes partition"
    if causal and outer == "allgather" and partition == "striped" and po > 1:
        return r"partition 'striped' gives a rank \d+ runs"
    return None


@shapes
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("outer", OUTERS)
@pytest.mark.parametrize("partition", ["contiguous", "striped", "index_map"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_partitions(meshes, shape, inner, outer, partition, causal):
    problem = problem_for(shape, layout="bhse", causal=causal)
    s, po = problem.q.shape[2], shape[1]
    rows = index_map(s, po, causal) if partition == "index_map" else partition
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer=outer, partition=rows)
    refused = refusal(outer, partition, causal, po)
    if refused:
        with pytest.raises(ValueError, match=rf"schedule 'hybrid', outer dim 'seq' \({outer} over "
                                             rf"{po} ranks\): .*{refused}"):
            run_schedule(sched, problem)
        return
    assert_matches(problem, run_schedule(sched, problem))


@shapes
@pytest.mark.parametrize("inner", INNERS)
def test_bf16_and_ring_transport_option(meshes, shape, inner):
    problem = problem_for(shape, s=8 * shape[0] * shape[1], e=16, layout="bshe", causal=True,
                          dtype=torch.bfloat16)
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer="ring", transport="p2p")
    assert sched.outer.transport == "p2p"
    assert_matches(problem, run_schedule(sched, problem))


@shapes
def test_dims_by_name(meshes, shape):
    """Any dim names; inner_dim picks the dim (here the second), outer_dim is the other."""
    m = meshes(shape, ("ring_dim", "a2a_dim"))
    sched = schedules.get("hybrid", m, inner_dim="a2a_dim")
    assert (sched.inner.dim, sched.outer.dim) == ("a2a_dim", "ring_dim")
    problem = problem_for(shape[::-1], layout="bshe", causal=True)
    assert_matches(problem, run_schedule(sched, problem))


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("outer", OUTERS)
def test_1xP_equals_the_outer_schedule(meshes, mesh, inner, outer):
    p = mesh.size()
    problem = problem_for((1, p), layout="bshe", causal=True)
    hybrid = schedules.get("hybrid", meshes((1, p)), inner=inner, outer=outer)
    one_d = schedules.get(outer, mesh)
    for got, want in zip(run_schedule(hybrid, problem), run_schedule(one_d, problem)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("outer", OUTERS)
def test_Px1_equals_the_inner_schedule(meshes, mesh, inner, outer):
    p = mesh.size()
    problem = problem_for((p, 1), layout="bshe", causal=True)
    hybrid = schedules.get("hybrid", meshes((p, 1)), inner=inner, outer=outer)
    options = {"partition": "contiguous"} if inner == "ulysses" else {}
    one_d = schedules.get(inner, mesh, **options)
    for got, want in zip(run_schedule(hybrid, problem), run_schedule(one_d, problem)):
        assert torch.equal(got, want)


class _SplitRecorder(ReferenceKernel):
    """The reference kernel, recording the mesh dims it is asked to split heads over."""

    def __init__(self):
        self.splits = []

    def split_heads(self, mesh, dim):
        self.splits.append(dim)
        return self


@shapes
def test_head_split_reaches_the_local_kernel(meshes, shape):
    """With inner head_parallel every local call of the outer schedule runs the kernel split
    over the inner dim (the nvFuser kernel then carries the DID annotation: see
    tests/test_hybrid_fusion.py)."""
    problem = problem_for(shape, layout="bshe", causal=True)
    kernel = _SplitRecorder()
    sched = schedules.get("hybrid", meshes(shape), inner="head_parallel")
    assert_matches(problem, run_schedule(sched, problem, kernel=kernel))
    assert kernel.splits == (["heads", "heads"] if shape[0] > 1 else [])  # forward, backward


# ---- packed sequences (THD) ---------------------------------------------------------------
def packed_for(shape, *, kv="gqa", padded=False, causal=False):
    """Sequences of 0 and 1 tokens, some not divisible by 2P (P all ranks), one of 4P; 2 query
    heads per inner rank; ``kv``: "gqa" (2 query heads per K/V head) or "fewer" (one K/V
    head); ``padded``: slots of user padding (cu_seqlens_padded)."""
    pi, po = shape
    p = pi * po
    return make_packed([2 * p + 1, 0, 1, 4 * p, p + 3], h=2 * pi, h_kv={"gqa": pi, "fewer": 1}[kv],
                       slack=[1, 2, 0, 3, 0] if padded else None, causal=causal, scale=0.4)


PACKINGS = [("gqa", True), ("fewer", False)]


@shapes
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("outer", OUTERS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv, padded", PACKINGS, ids=["gqa-cu_seqlens_padded", "fewer-cu_seqlens"])
def test_packed_matches_reference(meshes, shape, inner, outer, causal, kv, padded):
    """Forward and backward per sequence; padding outputs and gradients zero (``run_packed``).
    With cu_seqlens_padded the call takes this rank's ``pack(...)``, else the global
    cu_seqlens."""
    problem = packed_for(shape, kv=kv, padded=padded, causal=causal)
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer=outer)
    assert_packed_matches(problem, run_packed(sched, problem, local=padded, kv_copies=True))


@shapes
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("partition", ["load_balanced", "striped"])
def test_packed_positions_are_those_of_one_process(meshes, shape, inner, partition):
    """position_ids of this rank's tokens are their positions in their sequences (0 for
    padding); shard then unshard gives back every real token (zero in the padding slots).
    Dense: position_ids are the positions of the tokens shard gives."""
    problem = packed_for(shape, padded=True)
    sched = schedules.get("hybrid", meshes(shape), inner=inner, partition=partition)
    local = sched.pack(problem.cu_seqlens, problem.cu_seqlens_padded)
    real = local.token_index >= 0
    assert torch.equal(local.position_ids[real], global_positions(problem)[local.token_index[real]])
    assert not local.position_ids[~real].any()
    kw = dict(layout="thd", cu_seqlens=problem.cu_seqlens,
              cu_seqlens_padded=problem.cu_seqlens_padded)
    in_a_sequence = torch.zeros(problem.q.shape[0], dtype=torch.bool)
    for start, n in sequences(problem):
        in_a_sequence[start:start + n] = True
    back = sched.unshard(sched.shard(problem.q, **kw), **kw)
    assert torch.equal(back, torch.where(in_a_sequence[:, None, None], problem.q, 0.0))
    s = 8 * shape[0] * shape[1]  # dense: the positions of the tokens shard gives this rank
    positions = torch.arange(s, dtype=torch.float32).view(1, 1, s, 1)
    assert torch.equal(sched.position_ids(s), sched.shard(positions).flatten().long())


@pytest.mark.parametrize("inner, outer, line", [
    ("ulysses", "ring", "1xP"), ("ulysses", "allgather", "1xP"), ("head_parallel", "ring", "1xP"),
    ("head_parallel", "allgather", "1xP"), ("ulysses", "ring", "Px1"), ("head_parallel", "ring", "Px1"),
])
def test_packed_lines_equal_the_1d_schedules(meshes, mesh, inner, outer, line):
    """1xP equals the outer schedule over all ranks, Px1 the inner one."""
    p = mesh.size()
    shape = (1, p) if line == "1xP" else (p, 1)
    problem = packed_for(shape, padded=True, causal=True)
    hybrid = schedules.get("hybrid", meshes(shape), inner=inner, outer=outer)
    one_d = schedules.get(outer, mesh) if line == "1xP" else schedules.get(inner, mesh)
    for got, want in zip(run_packed(hybrid, problem), run_packed(one_d, problem)):
        assert torch.equal(got, want)


# ---- errors -----------------------------------------------------------------------------
def test_one_dim_mesh_is_refused(mesh):
    sched = schedules.get("hybrid", mesh)
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"schedule 'hybrid' needs a mesh of two dims \(inner x "
                                         r"outer\), got the 1-D mesh \('seq',\)"):
        sdpa_fusion.attention(q, q, q, schedule=sched, kernel="reference")
    with pytest.raises(ValueError, match="needs a mesh of two dims"):
        sched.shard(q)


@pytest.mark.parametrize("options, message", [
    (dict(inner_dim="tokens"), r"inner_dim='tokens' is not a dim of the mesh; its dims are "
                               r"\['heads', 'seq'\]"),
    (dict(inner_dim="seq", outer_dim="seq"), "inner_dim and outer_dim must be two different"),
    (dict(inner="ring"), r"inner='ring' is not known for schedule 'hybrid'; choose one of "
                         r"\['head_parallel', 'ulysses'\]"),
    (dict(outer="ulysses"), "outer='ulysses' is not known"),
    (dict(partition="zigzag"), "partition='zigzag' is not known"),
    (dict(transport="pigeon"), "transport='pigeon' is not known"),
])
def test_bad_options(meshes, options, message):
    sched = schedules.get("hybrid", meshes(SHAPES[0]), **options)
    q = torch.randn(1, 4, 16, 8)
    with pytest.raises(ValueError, match=message):
        sdpa_fusion.attention(q, q, q, schedule=sched, kernel="reference")
    with pytest.raises(ValueError, match=message):
        sched.describe(sdpa_fusion.AttentionSpec(1, 4, 4, 16, 16, 8))


@pytest.mark.usefixtures("several_ranks")
def test_bad_dim_on_one_rank_then_a_correct_call(meshes, mesh):
    shape = SHAPES[0]
    m = meshes(shape)
    problem = problem_for(shape, layout="bshe", causal=True)
    good = schedules.get("hybrid", m)
    bad = Hybrid(m, inner_dim="nope") if mesh.rank == 0 else good  # built alone: no agreement
    q, k, v = (good.shard(t, layout="bshe") for t in (problem.q, problem.k, problem.v))
    with pytest.raises(ValueError, match=r"rank 0: inner_dim='nope' is not a dim of the mesh"):
        sdpa_fusion.attention(q, k, v, causal=True, layout="bshe", kernel="reference", schedule=bad)
    assert_matches(problem, run_schedule(good, problem))


@pytest.mark.usefixtures("several_ranks")
def test_heads_not_divisible_on_one_rank(meshes, mesh):
    """Ulysses over the inner dim needs heads divisible by its size; rank 0 passes one more."""
    shape = (mesh.size(), 1)
    problem = problem_for(shape, layout="bhse")
    sched = schedules.get("hybrid", meshes(shape), inner="ulysses")
    q, k, v = (sched.shard(t) for t in (problem.q, problem.k, problem.v))
    if mesh.rank == 0:
        q = k = v = torch.randn(1, shape[0] + 1, q.shape[2], 8)
    with pytest.raises(ValueError, match=rf"rank 0: schedule 'hybrid', inner dim 'heads' \(ulysses "
                                         rf"over {shape[0]} ranks\): heads={shape[0] + 1} must be "
                                         rf"divisible"):
        sdpa_fusion.attention(q, k, v, schedule=sched, kernel="reference")
    assert_matches(problem, run_schedule(sched, problem))


def test_sequence_not_divisible(meshes):
    pi, po = SHAPES[-1]
    m = meshes((pi, po))
    lb = schedules.get("hybrid", m, inner="head_parallel")
    s = 2 * po + 1
    with pytest.raises(ValueError, match=rf"sequence length {s} must be divisible by {2 * po} for "
                                         rf"load_balanced sharding over {po} ranks"):
        lb.shard(torch.randn(1, 2 * pi, s, 8))
    q = torch.randn(1, 2 * pi, 3, 8)  # the local part of 3 * po tokens
    if po > 1:
        with pytest.raises(ValueError, match=r"outer dim 'seq' \(ring over .*must be divisible"):
            sdpa_fusion.attention(q, q, q, schedule=lb, kernel="reference", causal=True)
    if pi > 1:
        ulysses = schedules.get("hybrid", m, inner="ulysses", partition="contiguous")
        s = po * (2 * pi + 1)
        with pytest.raises(ValueError, match=rf"sequence length {s} gives each of the {po} ranks of "
                                             rf"outer dim 'seq' {2 * pi + 1} tokens, which must be "
                                             rf"divisible by the {pi} ranks of inner dim 'heads'"):
            ulysses.shard(torch.randn(1, 2 * pi, s, 8))


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("inner", INNERS)
def test_packed_bad_input_on_one_rank_then_a_correct_call(meshes, mesh, inner):
    """Rank 0 passes the packing of another partition, then its full tensors."""
    shape = SHAPES[0]
    problem = packed_for(shape, causal=True)
    m = meshes(shape)
    sched = schedules.get("hybrid", m, inner=inner)
    striped = schedules.get("hybrid", m, inner=inner, partition="striped")
    cu = problem.cu_seqlens
    q, k, v = (sched.shard(t, layout="thd", cu_seqlens=cu) for t in (problem.q, problem.k, problem.v))
    mine = sched.pack(cu)
    local = striped.pack(cu) if mesh.rank == 0 else mine
    kw = dict(layout="thd", causal=True, kernel="reference", schedule=sched)
    with pytest.raises(ValueError, match=r"rank 0: cu_seqlens is .*, not this rank's part under "
                                         r"schedule 'hybrid' \(rank \d of \d+, partition "
                                         r"auto"):
        sdpa_fusion.attention(q, k, v, cu_seqlens=local, **kw)
    if mesh.rank == 0:
        q, k, v = problem.q, problem.k, problem.v
    with pytest.raises(ValueError, match=rf"rank 0: q has {problem.q.shape[0]} tokens but this "
                                         r"rank's part of the packing has \d+ "):  # rank 0's
        sdpa_fusion.attention(q, k, v, cu_seqlens=cu, **kw)
    assert_packed_matches(problem, run_packed(sched, problem, kv_copies=True))


@shapes
@pytest.mark.parametrize("inner", INNERS)
def test_dtensor_in_dtensor_out(meshes, shape, inner):
    """Contiguous partition; with inner ulysses the outer dim comes first in the mesh (here
    the one named "heads"), so that DTensor's Shard(2) over both dims (outer, then inner) is
    what each rank holds."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if inner == "head_parallel":
        m, inner_dim, placements = meshes(shape), "heads", [Shard(1), Shard(2)]
    else:
        m, inner_dim, placements = meshes(shape[::-1]), "seq", [Shard(2), Shard(2)]
    sched = schedules.get("hybrid", m, inner=inner, inner_dim=inner_dim, partition="contiguous")
    assert (sched.inner.size, sched.outer.size) == shape
    problem = problem_for(shape, causal=True)
    q, k, v = (distribute_tensor(t, m.torch_mesh, placements).requires_grad_()
               for t in (problem.q, problem.k, problem.v))
    out = sdpa_fusion.attention(q, k, v, causal=True, scale=problem.scale, schedule=sched,
                                kernel="reference")
    assert isinstance(out, DTensor) and list(out.placements) == placements
    out.backward(distribute_tensor(problem.dout, m.torch_mesh, placements))
    assert_matches(problem, [t.full_tensor() for t in (out, q.grad, k.grad, v.grad)])


def test_dtensor_of_other_tokens_is_refused(meshes):
    """The default load-balanced partition over several outer ranks is not DTensor's chunks."""
    from torch.distributed.tensor import Shard, distribute_tensor

    m = meshes(SHAPES[0])
    problem = problem_for(SHAPES[0])
    sched = schedules.get("hybrid", m)
    q = distribute_tensor(problem.q, m.torch_mesh, [Shard(2), Shard(2)])
    with pytest.raises(ValueError, match=r"the tokens of this rank under schedule 'hybrid' are not "
                                         r"the contiguous chunk .* partition='contiguous'"):
        sdpa_fusion.attention(q, q, q, schedule=sched, kernel="reference")


def test_unshard_copies_needs_a_choice(meshes, mesh):
    p = mesh.size()
    sched = schedules.get("hybrid", meshes((p, 1)), inner="head_parallel")
    k = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    local = sched.shard(k)
    assert torch.equal(sched.unshard(local, heads=1, copies="first"), k)
    torch.testing.assert_close(sched.unshard(local, heads=1, copies="sum"), p * k)
    if p > 1:
        with pytest.raises(ValueError, match=rf"hold copies of heads=1 heads; pass copies='sum'"):
            sched.unshard(local, heads=1)
    with pytest.raises(ValueError, match=rf"heads=3 does not match the {p} heads gathered"):
        sched.unshard(local, heads=3, copies="sum")


# ---- sliding windows ---------------------------------------------------------------------
@shapes
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("outer", OUTERS)
@pytest.mark.parametrize("layout", ["bhse", "thd"])
def test_sliding_window(meshes, shape, inner, outer, layout):
    """The outer schedule masks the window over its partition of the sequence (packed: of
    every sequence, user padding included)."""
    causal, window = (True, (3, 0)) if outer == "ring" else (False, (2, 5))
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer=outer)
    if layout == "thd":
        problem = make_packed([2 * shape[0] * shape[1] + 1, 0, 9], h=2 * shape[0], h_kv=shape[0],
                              slack=[1, 2, 0], causal=causal, scale=0.4, window=window)
        assert_packed_matches(problem, run_packed(sched, problem, kv_copies=True))
        return
    problem = problem_for(shape, causal=causal, window=window)
    assert_matches(problem, run_schedule(sched, problem))
