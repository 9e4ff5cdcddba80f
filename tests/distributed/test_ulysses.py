"""ulysses schedule vs the single-process reference, its errors and its byte counts.

    mpirun -np 2 python -m pytest tests/distributed/test_ulysses.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_ulysses.py
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion

from schedules.heads import PIPELINE_GROUPS

from .conftest import assert_matches, make_problem, run_schedule, schedule_with
from .packed import assert_packed_matches, make_packed, run_packed

PARTITIONS = ["contiguous", "load_balanced", "striped", "index_map"]


def index_map(s: int, p: int, causal: bool):
    """A random permutation split into rows; sorted within each row when causal (ulysses
    restores global order, so any increasing rows work)."""
    rows = torch.randperm(s, generator=torch.Generator().manual_seed(7)).view(p, -1)
    return (rows.sort(dim=1).values if causal else rows).tolist()


def schedule(mesh, partition: str, s: int, causal: bool):
    return schedule_with("ulysses", mesh, partition, lambda: index_map(s, mesh.size(), causal))


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_share", [1, 2, 0], ids=["mha", "gqa", "mqa"])
def test_matches_reference(mesh, partition, layout, causal, kv_share):
    """kv_share: query heads per K/V head (0: one K/V head, replicated when there are ranks)."""
    p = mesh.size()
    h = 2 * p
    s = 8 * p
    problem = make_problem(b=2, h=h, h_kv=h // kv_share if kv_share else 1, s=s, e=8,
                           layout=layout, causal=causal, scale=0.3)
    assert_matches(problem, run_schedule(schedule(mesh, partition, s, causal), problem))


@pytest.mark.parametrize("partition", ["load_balanced", "striped"])
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_keys_outnumber_queries(mesh, partition, layout):
    p = mesh.size()
    problem = make_problem(b=1, h=2 * p, h_kv=p, s=4 * p, s_kv=12 * p, e=8, layout=layout)
    sched = schedules.get("ulysses", mesh, partition=partition)
    assert_matches(problem, run_schedule(sched, problem))


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_bf16(mesh, layout):
    p = mesh.size()
    problem = make_problem(b=1, h=2 * p, h_kv=p, s=16 * p, e=16, layout=layout, causal=True,
                           dtype=torch.bfloat16)
    sched = schedules.get("ulysses", mesh, partition="load_balanced")
    assert_matches(problem, run_schedule(sched, problem), torch.bfloat16)


@pytest.mark.usefixtures("several_ranks")
def test_heads_not_divisible(mesh):
    p = mesh.size()
    sched = schedules.get("ulysses", mesh)
    q = torch.randn(1, p + 1, 2 * p, 16)
    with pytest.raises(ValueError, match=rf"heads={p + 1} must be divisible by the {p} ranks of "
                                         rf"schedule 'ulysses' .* use a multiple of {p} heads"):
        sdpa_fusion.attention(q, q, q, schedule=sched, kernel="reference")


@pytest.mark.usefixtures("several_ranks")
def test_kv_heads_neither_multiple_nor_divisor(mesh):
    p = mesh.size()
    sched = schedules.get("ulysses", mesh)
    q, kv = torch.randn(1, 3 * p, 2 * p, 16), torch.randn(1, 3, 2 * p, 16)
    with pytest.raises(ValueError, match=rf"kv_heads=3 must be divisible by the {p} ranks .* "
                                         rf"or divide {p} \(K/V heads are then replicated\)"):
        sdpa_fusion.attention(q, kv, kv, schedule=sched, kernel="reference")


def test_sequence_not_divisible(mesh):
    p = mesh.size()
    sched = schedules.get("ulysses", mesh, partition="load_balanced")
    q = torch.randn(1, 2 * p, 3, 16)
    with pytest.raises(ValueError, match=rf"sequence length {3 * p} must be divisible by {2 * p} "
                                         rf"for load_balanced sharding over {p} ranks; pad"):
        sdpa_fusion.attention(q, q, q, schedule=sched, kernel="reference")


def test_causal_with_any_index_map_matches_reference(mesh):
    """Ulysses attends the whole sequence in global order: causal works for rows in any order."""
    p = mesh.size()
    rows = torch.randperm(4 * p, generator=torch.Generator().manual_seed(3)).view(p, -1)
    rows = rows.sort(dim=1, descending=True).values.tolist()
    sched = schedules.get("ulysses", mesh, partition=rows)
    problem = make_problem(b=1, h=2 * p, h_kv=p, s=4 * p, e=8, layout="bshe", causal=True)
    assert_matches(problem, run_schedule(sched, problem))


def _formula(spec, p):
    """Bytes per rank, forward and backward, from the definition: (P-1)/P of what each
    all-to-all moves."""
    token_head = spec.batch * (spec.q_len // p) * spec.head_dim * spec.dtype.itemsize
    h, h_kv = spec.heads // p, max(spec.kv_heads // p, 1)
    lse = spec.batch * h * (spec.q_len // p) * 4
    qkv = (h + 2 * h_kv) * token_head
    forward = (p - 1) * (qkv + h * token_head + lse)                  # q,k,v; out; lse
    backward = (p - 1) * (qkv + 2 * h * token_head + lse + qkv)        # dout,q,k,v,out; lse; grads
    return forward, backward


@pytest.mark.parametrize("kv_heads", [8, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_describe_formula(mesh, kv_heads, causal):
    p = mesh.size()
    spec = sdpa_fusion.AttentionSpec(2, 8, kv_heads, 64 * p, 64 * p, 64, causal=causal)
    d = schedules.get("ulysses", mesh).describe(spec)
    forward, backward = _formula(spec, p)
    assert (d.bytes_sent, d.bytes_received) == (forward, forward)
    assert (d.backward_bytes_sent, d.backward_bytes_received) == (backward, backward)
    assert d.flops == pytest.approx(spec.flops() / p)
    assert d.backward_flops == pytest.approx(2.5 * spec.flops() / p)


@pytest.mark.parametrize("kv, groups", [("half", 1), ("one", 1), ("two", 2)],
                         ids=["gqa", "mqa", "gqa-2-groups"])
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_describe_matches_communicator(mesh, layout, kv, groups):
    """Bytes and transfers as describe() says, K/V heads replicated in every head group too
    (2 K/V heads in 2 groups: one per group, fewer than the ranks)."""
    p = mesh.size()
    h = 2 * p
    kv_heads = {"half": h // 2, "one": 1, "two": 2}[kv]
    problem = make_problem(b=1, h=h, h_kv=kv_heads, s=8 * p, e=8,
                           layout=layout, causal=True, dtype=torch.bfloat16)
    sched = schedules.get("ulysses", mesh, partition="load_balanced", head_groups=groups)
    q, k, v = (sched.shard(t, layout=layout).requires_grad_() for t in (problem.q, problem.k, problem.v))
    d = sched.describe(sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, layout=layout)))
    sched.comm.stats.reset()
    out = sdpa_fusion.attention(q, k, v, causal=True, layout=layout, kernel="reference", schedule=sched)
    stats = sched.comm.stats
    assert (stats.bytes_sent, stats.bytes_received, stats.transfers) == (
        d.bytes_sent, d.bytes_received, 3 * groups)
    out.backward(sched.shard(problem.dout, layout=layout))
    assert (stats.bytes_sent, stats.bytes_received, stats.transfers) == (
        d.bytes_sent + d.backward_bytes_sent, d.bytes_received + d.backward_bytes_received,
        6 * groups)


@pytest.mark.parametrize("kv_heads, groups", [("h", 1), (1, 1), (2, 2)],
                         ids=["mha", "mqa", "gqa-2-groups"])
def test_packed_describe_matches_communicator(mesh, kv_heads, groups):
    """Packed, only real tokens travel (the dK/dV of replicated K/V heads as blocks of every
    local row): sequences padded to 2P chunks, empty and one-token ones,
    ranks with different real counts; describe() says what each rank sends and receives,
    with K/V heads replicated in every head group too (2 K/V heads in 2 groups)."""
    p = mesh.size()
    h = 2 * p
    problem = make_packed([3 * p + 1, 0, 1, 5], h=h, h_kv=h if kv_heads == "h" else kv_heads,
                          causal=True)
    sched = schedules.get("ulysses", mesh, head_groups=groups)
    cu = problem.cu_seqlens
    kw = dict(layout="thd", cu_seqlens=cu)
    d = sched.describe(sdpa_fusion.AttentionSpec.from_tensors(
        problem.q, problem.k, problem.v, layout="thd", cu_seqlens=cu, causal=True))
    q, k, v = (sched.shard(t, **kw).requires_grad_() for t in (problem.q, problem.k, problem.v))
    sched.comm.stats.reset()
    out = sdpa_fusion.attention(q, k, v, causal=True, kernel="reference", schedule=sched, **kw)
    stats = sched.comm.stats
    assert (stats.bytes_sent, stats.bytes_received) == (d.bytes_sent, d.bytes_received)
    out.backward(sched.shard(problem.dout, **kw))
    assert (stats.bytes_sent, stats.bytes_received) == (
        d.bytes_sent + d.backward_bytes_sent, d.bytes_received + d.backward_bytes_received)


@pytest.mark.parametrize("kv", ["mha", "replicated"])
@pytest.mark.parametrize("lengths", ["mixed", "one-token"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_pipeline_matches_reference(mesh, kv, lengths, causal):
    """Four packed head groups through the pipeline (a group's heads travel while the one
    before is attended, its results while the next one is), forward and backward: MHA, and
    one K/V head per group replicated over the ranks (its dK/dV summed as blocks); a
    one-token batch leaves every rank but one without a real token."""
    p = mesh.size()
    h = 4 * p
    sizes = [3 * p + 1, 0, 1, 5 * p, 2] if lengths == "mixed" else [1]
    problem = make_packed(sizes, h=h, h_kv=h if kv == "mha" else 4, causal=causal, scale=0.3)
    sched = schedules.get("ulysses", mesh, head_groups=4)
    assert_packed_matches(problem, run_packed(sched, problem))


def test_auto_pipelines_packed_calls_over_copy_engines(mesh, monkeypatch):
    """With a transport that overlaps the kernel, ``auto`` runs packed calls in
    PIPELINE_GROUPS head groups (as many as the heads allow), dense calls in one."""
    p = mesh.size()
    sched = schedules.get("ulysses", mesh)
    packed = sdpa_fusion.AttentionSpec(1, 8 * p, 8 * p, 64, 64, 8, torch.float32, causal=True,
                                       layout="thd", cu_seqlens=(0, 40, 64))
    dense = packed.replace(layout="bshe", cu_seqlens=None)
    assert sched.groups_for(packed) == sched.groups_for(dense) == 1  # p2p: nothing overlaps
    monkeypatch.setattr(sched, "keeps_buffers", lambda: True)
    assert sched.groups_for(packed) == PIPELINE_GROUPS
    assert sched.groups_for(dense) == 1
    few = packed.replace(heads=2 * p, kv_heads=2 * p)  # two groups of P heads at most
    assert sched.groups_for(few) == 2
