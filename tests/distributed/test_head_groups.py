"""Head groups and the dtype dK/dV sums travel in, under every sequence schedule, vs the
reference (tests/reference.py): dense (BHSE, BSHE) and packed, causal and not, GQA; the ring's
traffic with groups, counted as torch.distributed sees it (tests/comms.py).

    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_head_groups.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import schedules
import sdpa_fusion
from schedules import heads
from tests.comms import counting

from .conftest import assert_matches, make_problem, run_schedule
from .packed import assert_packed_matches, make_packed, run_packed
from .test_ring import _Recording

SCHEDULES = ["ring", "allgather", "ulysses"]


def heads_for(name: str, p: int, groups: int) -> int:
    """Query heads that split into ``groups`` groups under every schedule (ulysses: each
    group's heads divisible by P)."""
    return groups * p if name == "ulysses" else 2 * groups


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("layout, gqa", [("bhse", False), ("bshe", True)],
                         ids=["bhse-mha", "bshe-gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_head_groups_match_reference(mesh, name, layout, causal, gqa):
    p, groups = mesh.size(), 2
    h = heads_for(name, p, groups)
    h_kv = h // 2 if gqa and (name != "ulysses" or (h // 2 // groups) % p == 0) else h
    problem = make_problem(b=2, h=h, h_kv=h_kv, s=8 * p, e=8, layout=layout, causal=causal,
                           scale=0.5)
    sched = schedules.get(name, mesh, head_groups=groups)
    assert_matches(problem, run_schedule(sched, problem))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_head_groups_match_reference(mesh, name, causal):
    p, groups = mesh.size(), 2
    h = heads_for(name, p, groups)
    problem = make_packed([2 * p + 1, 0, 1, 4 * p, p + 3], h=h, h_kv=h, causal=causal,
                          scale=0.4)
    results = run_packed(schedules.get(name, mesh, head_groups=groups), problem)
    assert_packed_matches(problem, results)


def test_ring_head_groups_give_the_numbers_of_one_group(mesh):
    """Heads do not mix: every group computes what the whole call computes for its heads."""
    p = mesh.size()
    problem = make_problem(b=1, h=8, h_kv=4, s=8 * p, e=8, layout="bshe", causal=True,
                           dtype=torch.bfloat16)
    one, four = (run_schedule(schedules.get("ring", mesh, head_groups=g), problem)
                 for g in (1, 4))
    for a, b in zip(one, four):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_ring_sums_in_input_dtype_when_they_round_nothing(mesh, layout):
    """grad_dtype='auto' (bf16 sums at P = 2 without a window, fp32 otherwise: a windowed
    step may add several calls into one block's sums) gives the numbers of fp32 sums."""
    p = mesh.size()
    problem = make_problem(b=1, h=4, h_kv=2, s=8 * p, e=16, layout=layout, causal=True,
                           dtype=torch.bfloat16)
    auto = schedules.get("ring", mesh, grad_dtype="auto")
    wide = schedules.get("ring", mesh, grad_dtype="fp32")
    spec = sdpa_fusion.AttentionSpec(1, 4, 2, 8 * p, 8 * p, 16, torch.bfloat16, causal=True)
    assert auto.sums_dtype(spec) == (torch.bfloat16 if p == 2 else torch.float32)
    assert auto.sums_dtype(spec.replace(window=(3, 0))) == torch.float32
    for a, b in zip(run_schedule(auto, problem), run_schedule(wide, problem)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_sums_in_bf16_at_any_size(mesh, causal):
    """grad_dtype='input': sums travel (and round) in bf16 on every hop."""
    p = mesh.size()
    problem = make_problem(b=1, h=4, s=16 * p, e=16, causal=causal, dtype=torch.bfloat16)
    sched = schedules.get("ring", mesh, grad_dtype="input", head_groups=2)
    assert_matches(problem, run_schedule(sched, problem))
    packed = make_packed([4 * p + 3, 1, 6 * p], h=4, h_kv=2, e=16, causal=causal,
                         dtype=torch.bfloat16)
    assert_packed_matches(packed, run_packed(sched, packed))


def test_ring_traffic_with_groups_and_bf16_sums(mesh):
    """Bytes moved (as torch.distributed sees them): the K/V blocks and, in backward, the sums
    in their dtype; per group P - 1 shifts forward, twice as many backward (K/V, sums)."""
    p = mesh.size()
    problem = make_problem(b=1, h=4, s=8 * p, e=8, causal=True, dtype=torch.bfloat16)
    sched = schedules.get("ring", mesh, head_groups=2, grad_dtype="input")
    q, k, v = (sched.shard(t).requires_grad_() for t in (problem.q, problem.k, problem.v))
    promised = sched.describe(sched.global_spec(
        sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True)))
    with counting() as seen:
        out = sdpa_fusion.attention(q, k, v, causal=True, kernel="reference", schedule=sched)
        out.backward(sched.shard(problem.dout))
    kv_bytes = 2 * k.numel() * k.element_size()
    assert seen.sent(sched.group) == promised.bytes_sent + promised.backward_bytes_sent
    assert promised.backward_bytes_sent == (p - 1) * 2 * kv_bytes  # K/V and bf16 sums
    assert seen.ops(sched.group) == {"batch_isend_irecv": 2 * 2 * (p - 1) + 2 * (p - 1)}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "thd"])
def test_head_groups_under_a_window_match_reference(mesh, name, packed):
    """Every group takes the window's calls (the ring: only the steps some rank needs,
    several hops at once; allgather: the calls of every rank's block in rank order)."""
    p, groups = mesh.size(), 2
    h = heads_for(name, p, groups)
    sched = schedules.get(name, mesh, head_groups=groups)
    if packed:
        problem = make_packed([6 * p + 1, 0, 1, 4 * p], h=h, causal=True, scale=0.4,
                              window=(3, 1))
        assert_packed_matches(problem, run_packed(sched, problem))
        return
    problem = make_problem(b=2, h=h, h_kv=h if name == "ulysses" else h // 2, s=16 * p, e=8,
                           layout="bshe", causal=True, scale=0.5, window=(3, 0))
    assert_matches(problem, run_schedule(sched, problem))


def test_windowed_ring_traffic_with_groups(mesh):
    """Under a causal window of 3 over chunks of 8 every group shifts K/V (and sums) to the
    steps some rank needs only (load_balanced: 1 and P - 1): twice the shifts of one group,
    each half the bytes, as describe() says."""
    p = mesh.size()
    problem = make_problem(b=1, h=4, s=16 * p, e=8, causal=True, window=(3, 0))
    seen = {}
    for groups in (1, 2):
        sched = schedules.get("ring", mesh, head_groups=groups)
        q, k, v = (sched.shard(t).requires_grad_() for t in (problem.q, problem.k, problem.v))
        promised = sched.describe(sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(
            q, k, v, causal=True, window=(3, 0))))
        with counting() as moved:
            out = sdpa_fusion.attention(q, k, v, causal=True, window=(3, 0), kernel="reference",
                                        schedule=sched)
            out.backward(sched.shard(problem.dout))
        assert moved.sent(sched.group) == promised.bytes_sent + promised.backward_bytes_sent
        assert set(moved.ops(sched.group)) <= {"batch_isend_irecv"}, str(moved)
        seen[groups] = moved.calls(group=sched.group), moved.sent(sched.group), promised.steps
        assert_matches(problem, [sched.unshard(t) for t in (out, q.grad, k.grad, v.grad)])
    (shifts, sent, steps), grouped = seen[1], seen[2]
    assert grouped == (2 * shifts, sent, 2 * steps)
    assert steps == min(p, 3) and shifts == 3 * (steps - 1)  # K/V twice, sums once


def test_auto_sizes_a_windowed_ring_by_the_window(mesh, monkeypatch):
    """head_groups='auto' sizes the groups of a windowed ring by the window's span (keys a
    query may see), not by the block's rows: blocks that take two groups take one under a
    window of 3, forward and backward (no split), with the reference's numbers."""
    p, events = mesh.size(), []
    monkeypatch.setattr(heads, "MIN_GROUP_WORK", 64)  # 8 heads x 16 rows: two groups of 4
    problem = make_problem(b=1, h=8, s=16 * p, e=8, causal=True, window=(3, 0))
    sched = schedules.get("ring", mesh)
    spec = sdpa_fusion.AttentionSpec(1, 8, 8, 16 * p, 16 * p, 8, causal=True)
    assert sched.groups_for(spec) == 2
    assert sched.groups_for(dataclasses.replace(spec, window=(3, 0))) == 1  # 8 x 4 < 64
    q, k, v = (sched.shard(t).requires_grad_() for t in (problem.q, problem.k, problem.v))
    out = sdpa_fusion.attention(q, k, v, causal=True, window=(3, 0), scale=problem.scale,
                                kernel=_Recording(events), schedule=sched)
    out.backward(sched.shard(problem.dout))
    assert events and {kv_heads for _, kv_heads, _ in events} == {8}
    assert_matches(problem, [sched.unshard(t) for t in (out, q.grad, k.grad, v.grad)])


@pytest.mark.parametrize("name", SCHEDULES)
def test_groups_that_do_not_divide_are_refused_on_every_rank(mesh, several_ranks, name):
    """A head_groups that does not divide the K/V heads raises on every rank (here one rank
    alone has a bad count of K/V heads), then a good call runs."""
    p = mesh.size()
    sched = schedules.get(name, mesh, head_groups=2)
    h = heads_for(name, p, 2)
    problem = make_problem(b=1, h=h, s=8 * p, e=8)
    q = sched.shard(problem.q)
    k = torch.randn(1, 1 if mesh.rank == 0 else h, q.shape[2], 8)  # one K/V head on rank 0
    with pytest.raises(ValueError, match=r"rank 0: head_groups=2 must divide the 1 K/V heads"):
        sdpa_fusion.attention(q, k, k, kernel="reference", schedule=sched)
    assert_matches(problem, run_schedule(sched, problem))


def test_ulysses_groups_must_leave_heads_for_every_rank(mesh, several_ranks):
    p = mesh.size()
    sched = schedules.get("ulysses", mesh, head_groups=2)
    q = torch.randn(1, p, 8, 8)  # p heads in 2 groups: p/2 per group, not divisible by p
    with pytest.raises(ValueError, match=rf"head_groups=2 leaves {p // 2} query .* needs query "
                                         rf"heads per group divisible by {p}"):
        sdpa_fusion.attention(q, q, q, kernel="reference", schedule=sched)


