"""What ``describe()`` says each rank of a schedule moves and computes, against the formulas
written out from each schedule's definition, for every rank of meshes of 2, 4 and 8 ranks
planned on ``VirtualMesh`` (no process group). What the schedules really move is counted
under mpirun: tests/distributed/test_traffic.py.

Run: pytest -q tests/test_describe.py
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from schedules import dry_run
from sdpa_fusion import VirtualMesh
from tests.distributed.test_hybrid import mesh_shapes

WORLDS = [2, 4, 8]  # the world sizes the mpirun stages run
worlds = pytest.mark.parametrize("p", WORLDS, ids=lambda p: f"P{p}")
SHAPES = sorted({s for p in WORLDS for s in mesh_shapes(p)})  # (inner, outer) of the hybrids
shapes = pytest.mark.parametrize("shape", SHAPES, ids=[f"{i}x{o}" for i, o in SHAPES])


def ranks(p: int, shape=None, names=("seq",)):
    """A VirtualMesh for every rank of a mesh of ``shape`` (1-D of ``p`` ranks by default)."""
    shape = shape or (p,)
    return [VirtualMesh(shape, names, rank=r) for r in range(p)]


# ---- allgather ----------------------------------------------------------------------------
def _allgather_formula(spec, p, rank, partition):
    """Bytes and FLOPs of one rank, written out from the definition of the schedule."""
    s_l, itemsize = spec.q_len // p, spec.dtype.itemsize
    kv = 2 * spec.batch * spec.kv_heads * s_l * spec.head_dim  # K and V of one rank
    if not spec.causal:
        pairs = s_l * spec.q_len
    elif partition == "contiguous":
        pairs = s_l * s_l / 2 + rank * s_l * s_l
    else:  # load_balanced: every rank the same
        pairs = spec.q_len * spec.q_len / (2 * p)
    return ((p - 1) * kv * itemsize, (p - 1) * kv * (itemsize + 4),
            4 * spec.batch * spec.heads * spec.head_dim * pairs)


@worlds
@pytest.mark.parametrize("partition", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_allgather(p, partition, causal):
    """K/V of every other rank gathered, and again in backward with fp32 dK/dV sums
    reduce-scattered; FLOPs of the pairs each rank's queries see (load_balanced: equal)."""
    spec = sdpa_fusion.AttentionSpec(2, 8, 2, 64 * p, 64 * p, 64, causal=causal)
    for mesh in ranks(p):
        d = schedules.get("allgather", mesh, partition=partition).describe(spec)
        forward, backward, flops = _allgather_formula(spec, p, mesh.rank, partition)
        assert (d.bytes_sent, d.bytes_received) == (forward, forward), mesh
        assert (d.backward_bytes_sent, d.backward_bytes_received) == (backward, backward), mesh
        assert d.flops == pytest.approx(flops)
        assert d.backward_flops == pytest.approx(2.5 * flops)
        if partition == "load_balanced" or not causal:
            assert d.flops == pytest.approx(spec.flops() / p)


# ---- ulysses ------------------------------------------------------------------------------
def _ulysses_formula(spec, p, keep_forward: bool = False):
    """Bytes per rank, forward and backward, from the definition: (P-1)/P of what each
    all-to-all moves (backward: dout alone there when the forward kept q, k, v, out, lse)."""
    token_head = spec.batch * (spec.q_len // p) * spec.head_dim * spec.dtype.itemsize
    h, h_kv = spec.heads // p, max(spec.kv_heads // p, 1)
    lse = spec.batch * h * (spec.q_len // p) * 4
    qkv = (h + 2 * h_kv) * token_head
    forward = (p - 1) * (qkv + h * token_head + lse)                  # q,k,v; out; lse
    backward = (p - 1) * (qkv + 2 * h * token_head + lse + qkv)        # dout,q,k,v,out; lse; grads
    if keep_forward:
        backward = (p - 1) * (h * token_head + qkv)                     # dout; grads
    return forward, backward


@worlds
@pytest.mark.parametrize("kv_heads", [8, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("keep", [True, False], ids=["keep", "resend"])
def test_ulysses(p, kv_heads, causal, keep):
    """q, k, v to heads and out, lse back; backward dout there (with them again unless the
    forward kept them) and the gradients back; 1/P of the FLOPs on every rank."""
    spec = sdpa_fusion.AttentionSpec(2, 8, kv_heads, 64 * p, 64 * p, 64, causal=causal)
    forward, backward = _ulysses_formula(spec, p, keep)
    for mesh in ranks(p):
        d = schedules.get("ulysses", mesh, keep_forward=keep).describe(spec)
        assert (d.bytes_sent, d.bytes_received) == (forward, forward), mesh
        assert (d.backward_bytes_sent, d.backward_bytes_received) == (backward, backward), mesh
        assert d.flops == pytest.approx(spec.flops() / p)
        assert d.backward_flops == pytest.approx(2.5 * spec.flops() / p)


# ---- head_parallel, ring, memory ------------------------------------------------------------
@worlds
def test_head_parallel_has_no_communication(p):
    spec = sdpa_fusion.AttentionSpec(1, 8 * p, 8 * p, 128, 128, 64, causal=True)
    for mesh in ranks(p):
        d = schedules.get("head_parallel", mesh).describe(spec)
        assert (d.bytes_sent, d.bytes_received) == (0, 0)
        assert (d.backward_bytes_sent, d.backward_bytes_received) == (0, 0)
        assert d.flops == pytest.approx(spec.flops() / p)


@worlds
def test_ring_reports_groups_and_memory(p):
    """The head groups in the notes, a step per rank and group, memory of the step."""
    spec = sdpa_fusion.AttentionSpec(1, 32, 32, 256 * 1024, 256 * 1024, 128, causal=True)
    for mesh in ranks(p):
        d = schedules.get("ring", mesh).describe(spec)
        groups = schedules.get("ring", mesh).group_count(32, 32, 256 * 1024 // p)
        assert f"{groups} head group(s)" in d.notes and d.steps == p * groups
        assert d.memory.step > d.memory.outputs > 0


@worlds
def test_memory_shrinks_with_groups(p):
    """Every transient buffer divides by the number of groups: 128K tokens, 32 heads of 128."""
    spec = sdpa_fusion.AttentionSpec(1, 32, 32, 128 * 1024, 128 * 1024, 128, causal=True)
    for name in ("ring", "allgather", "ulysses"):
        for mesh in ranks(p):
            steps = [schedules.get(name, mesh, head_groups=g).describe(spec).memory.step
                     for g in (1, 2, 4)]
            assert steps[0] > steps[1] > steps[2], (name, mesh)


# ---- hybrid ---------------------------------------------------------------------------------
def packed_rows(slots, pi: int, po: int) -> tuple[int, int]:
    """(tokens each outer rank holds, tokens each rank holds) of packed sequences in ``slots``
    tokens: each slot rounded up to 2·Po and load-balanced over Po, each outer rank's part
    rounded up to Pi and split contiguously over Pi (with inner ulysses)."""
    parts = [-(-n // (2 * po)) * 2 for n in slots]
    return sum(parts), sum(-(-n // pi) for n in parts)


def expected_dims(spec, inner, outer, pi, po, rows=None):
    """(forward bytes, backward bytes) of each dim per rank, from the definitions of the
    schedules, for the global ``spec``; ``rows`` (tokens per outer rank, per rank) of a packed
    spec (dense: S/Po, S/(Po·Pi))."""
    b, e, size = spec.batch, spec.head_dim, spec.dtype.itemsize
    h, h_kv = spec.heads, spec.kv_heads
    line, mine = rows or (spec.q_len // po, spec.q_len // po // pi)
    kv_heads = max(h_kv // pi, 1)  # K/V heads per inner rank
    if inner == "ulysses":  # all-to-alls over the tokens of one outer rank
        token_head = b * mine * e * size
        qkv = (h // pi + 2 * kv_heads) * token_head
        lse = b * (h // pi) * mine * 4
        fwd = (pi - 1) * (qkv + h // pi * token_head + lse)
        bwd = (pi - 1) * (qkv + 2 * h // pi * token_head + lse + qkv)
        inner_cost = (fwd, bwd)
    else:
        inner_cost = (0, 0)
    block = 2 * b * kv_heads * line * e  # K and V of one outer rank, H_kv/Pi heads
    # dK/dV sums travel in bf16 at P = 2: the ring's, and packed allgather's (one gathered
    # call per rank, so its key sets are disjoint)
    sums = size if po == 2 and (outer == "ring" or spec.layout.is_varlen) else 4
    outer_cost = ((po - 1) * block * size, (po - 1) * block * (size + sums))
    return inner_cost, outer_cost


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
@pytest.mark.parametrize("outer", ["ring", "allgather"])
@pytest.mark.parametrize("kv_heads", [16, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("layout", ["bhse", "thd"])
def test_hybrid(shape, inner, outer, kv_heads, layout):
    """Each dim's bytes as its schedule's definition gives them, the outer schedule's memory
    that of its 1-D self for H/Pi heads, steps and FLOPs the outer schedule's, bytes the sum
    of both dims. Packed: sequences of 300 and 5 tokens in slots of 301 and 37 tokens."""
    pi, po = shape
    if layout == "thd":
        spec = sdpa_fusion.AttentionSpec(1, 16, kv_heads, 338, 338, 64, causal=True, layout="thd",
                                         cu_seqlens=(0, 300, 306), cu_seqlens_padded=(0, 301, 338))
        rows = packed_rows([301, 37], pi, po)
    else:
        spec = sdpa_fusion.AttentionSpec(2, 16, kv_heads, 64 * pi * po, 64 * pi * po, 64,
                                         causal=True)
        rows = None
    for mesh in ranks(pi * po, shape, ("heads", "seq")):
        sched = schedules.get("hybrid", mesh, inner=inner, outer=outer,
                              partition="load_balanced")
        d = sched.describe(spec)
        assert [c.dim for c in d.dims] == ["heads", "seq"]
        for cost, (fwd, bwd) in zip(d.dims, expected_dims(spec, inner, outer, pi, po, rows)):
            got = cost.description
            assert (got.bytes_sent, got.bytes_received) == (fwd, fwd), (cost.dim, mesh)
            assert (got.backward_bytes_sent, got.backward_bytes_received) == (bwd, bwd), \
                (cost.dim, mesh)
        # the outer schedule holds what its 1-D self holds for H/Pi heads over Po ranks
        one_d = schedules.get(outer, mesh, dim="seq", partition="load_balanced")
        heads = spec.replace(heads=spec.heads // pi, kv_heads=max(spec.kv_heads // pi, 1))
        assert d.dims[1].description.memory == one_d.describe(heads).memory
        assert d.dims[1].backward_memory > d.dims[1].memory > 0
        inner_d, outer_d = (c.description for c in d.dims)
        assert outer_d.steps == d.steps and outer_d.ranks == po and inner_d.ranks == pi
        assert d.bytes_sent == inner_d.bytes_sent + outer_d.bytes_sent
        assert d.backward_bytes_sent == inner_d.backward_bytes_sent + outer_d.backward_bytes_sent
        if outer == "ring":
            assert d.steps == d.backward_steps == po
            assert d.flops == pytest.approx(spec.flops() / (pi * po))
            # the ring moves K/V of H_kv/Pi heads: 1/Pi of what a 1-D ring over Po ranks would
            one_d = schedules.get("ring", mesh, dim="seq", partition="load_balanced").describe(spec)
            assert outer_d.bytes_sent == one_d.bytes_sent * max(kv_heads // pi, 1) // kv_heads



# ---- describe() against a dry run of the code ------------------------------------------------
def _problems(p: int):
    """(name, global spec) of dense causal, full and windowed problems and a packed batch."""
    dense = dict(batch=1, heads=4 * p, kv_heads=2 * p, q_len=32 * p, kv_len=32 * p, head_dim=16)
    lengths = [20 * p, 3, 0, 7, 5 * p + 1]
    cu = (0, *torch.tensor(lengths).cumsum(0).tolist())
    return [("causal", sdpa_fusion.AttentionSpec(**dense, causal=True)),
            ("full", sdpa_fusion.AttentionSpec(**dense)),
            ("window", sdpa_fusion.AttentionSpec(**dense, causal=True, window=(9, 0))),
            ("packed", sdpa_fusion.AttentionSpec(
                **{**dense, "q_len": cu[-1], "kv_len": cu[-1]}, causal=True, layout="thd",
                cu_seqlens=cu))]


@pytest.mark.parametrize("p", [2, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("name, options", [
    ("ring", {}), ("ring", {"partition": "documents"}), ("allgather", {}),
    ("allgather", {"partition": "documents"}), ("head_parallel", {})],
    ids=["ring", "ring-documents", "allgather", "allgather-documents", "head_parallel"])
def test_described_bytes_and_flops_are_those_of_the_code(p, name, options):
    """What describe() says each rank moves is what a dry run of the schedule's own forward
    and backward counts (schedules/dry_run.py), to the byte; its FLOPs add up to the dry
    run's over the ranks (describe may give each rank the mean). Ulysses describes itself
    by that dry run: ``test_ulysses`` holds it to the formulas, tests/distributed/test_traffic.py
    to what torch.distributed moves."""
    dim = ("heads",) if name == "head_parallel" else ("seq",)
    for what, spec in _problems(p):
        if not (spec.layout.is_varlen and name == "head_parallel"):
            assert_described_as_run([schedules.get(name, mesh, **options)
                                     for mesh in ranks(p, names=dim)], spec, what)


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
@pytest.mark.parametrize("outer", ["ring", "allgather"])
def test_hybrid_described_bytes_and_flops_are_those_of_the_code(shape, inner, outer):
    p = shape[0] * shape[1]
    for what, spec in _problems(p):
        assert_described_as_run([schedules.get("hybrid", mesh, inner=inner, outer=outer)
                                 for mesh in ranks(p, shape, ("heads", "seq"))], spec, what)


def assert_described_as_run(scheds, spec, what: str) -> None:
    """Every rank's described bytes are its dry run's; the FLOPs add up alike."""
    flops = [0.0, 0.0]
    for sched in scheds:
        d = sched.describe(spec)
        forward, backward, _ = dry_run.run(sched, spec)
        where = (what, sched.mesh)
        assert (d.bytes_sent, d.bytes_received) == (forward.sent, forward.received), where
        assert (d.backward_bytes_sent, d.backward_bytes_received) == \
            (backward.sent, backward.received), where
        flops[0] += d.flops - forward.flops
        flops[1] += d.backward_flops - backward.flops
    assert flops == pytest.approx([0.0, 0.0], abs=1e-6 * spec.flops(backward=True)), what


@pytest.mark.parametrize("transport", ["p2p", "copy_engine"])
def test_a_dry_run_takes_the_transport_it_stands_for(transport):
    """Ulysses pipelines a packed batch in head groups only over copy engines (which keep
    their buffers): the dry run sees the transport the schedule would use, so it runs the
    groups a real call runs (one varlen call each way per group), its kept buffer counted."""
    cu = (0, 400, 720, 1024)
    spec = sdpa_fusion.AttentionSpec(1, 16, 16, 1024, 1024, 64, causal=True, layout="thd",
                                     cu_seqlens=cu)
    sched = schedules.get("ulysses", VirtualMesh((2,), ("seq",), rank=0), transport=transport)
    forward, backward, memory = dry_run.run(sched, spec)
    groups = sched.groups_for(spec)
    assert groups == (1 if transport == "p2p" else 2)
    assert (forward.calls, backward.calls) == (groups, groups)
    assert (memory.kept > 0) == (transport == "copy_engine")
