"""ulysses schedule vs the reference (tests/reference.py) and its errors (its describe():
tests/test_describe.py; its traffic: test_traffic.py).

    mpirun -np 2 python -m pytest tests/distributed/test_ulysses.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_ulysses.py
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import schedules
import sdpa_fusion
from tests.comms import counting

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
    assert_matches(problem, run_schedule(sched, problem))


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




def _counted_step(sched, problem, layout: str, **kw):
    """(results unsharded, what the forward moved, what the backward moved) of ``sched``."""
    q, k, v = (sched.shard(t, layout=layout, **kw).requires_grad_()
               for t in (problem.q, problem.k, problem.v))
    dout = sched.shard(problem.dout, layout=layout, **kw)
    with counting() as forward:
        out = sdpa_fusion.attention(q, k, v, causal=problem.causal, scale=problem.scale,
                                    layout=layout, kernel="reference", schedule=sched, **kw)
    with counting() as backward:
        out.backward(dout)
    results = [sched.unshard(t, layout=layout, **kw) for t in (out, q.grad, k.grad, v.grad)]
    return results, forward, backward


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("case", ["bhse", "thd", "documents"])
@pytest.mark.parametrize("groups", [1, 2])
def test_backward_reuses_what_the_forward_gathered(mesh, case, groups):
    """With ``keep_forward=True`` the backward sends dout to the heads' owners and nothing
    else of q, k, v, out, lse: it moves exactly the bytes of those less than without (the
    default; dense: what the forward moved, q, k, v there and out, lse back),
    makes one all-to-all fewer per head group, and gives the same numbers, bit for bit, as
    the reference does within tolerance; describe() says both. Packed "documents": whole
    documents beside one cut over every rank, whose heads are kept."""
    p = mesh.size()
    h = 2 * p * groups
    layout, options = ("bhse", {}) if case == "bhse" else ("thd", {})
    if case == "documents":
        options = dict(partition="documents")
        problem = make_packed([24 * p, 3, 5, 1, 7, 4], h=h, h_kv=h, causal=True, scale=0.3)
        kw = dict(cu_seqlens=problem.cu_seqlens)
    elif layout == "thd":
        problem = make_packed([3 * p + 1, 0, 1, 5 * p, 2], h=h, h_kv=h, causal=True, scale=0.3)
        kw = dict(cu_seqlens=problem.cu_seqlens)
    else:
        problem = make_problem(b=2, h=h, h_kv=h, s=8 * p, e=8, layout=layout, causal=True,
                               scale=0.3)
        kw = {}
    runs = {}
    for keep in (True, False):
        sched = schedules.get("ulysses", mesh, head_groups=groups, keep_forward=keep,
                              **options)
        runs[keep] = (sched, *_counted_step(sched, problem, layout, **kw))
    (sched, kept, forward, backward), (_, again, _, resent) = runs[True], runs[False]
    for name, a, b in zip(("out", "dq", "dk", "dv"), kept, again):
        assert torch.equal(a, b), name
    if layout == "thd":
        assert_packed_matches(problem, kept)
    else:
        assert_matches(problem, kept)
    group = sched.group
    assert backward.sent(group) < resent.sent(group)
    if layout != "thd":  # every rank sends every tensor's blocks alike
        assert resent.sent(group) - backward.sent(group) == forward.sent(group)
        assert backward.ops(group) == {"all_to_all_single": 2 * groups}
        assert resent.ops(group) == {"all_to_all_single": 3 * groups}
    spec = sdpa_fusion.AttentionSpec.from_tensors(problem.q, problem.k, problem.v, causal=True,
                                                  layout=layout, **kw)
    for keep, (s, _, _, moved) in runs.items():
        d = s.describe(spec)
        assert (moved.sent(group), moved.received(group)) == (
            d.backward_bytes_sent, d.backward_bytes_received), keep
        assert ("kept from forward" in d.notes) == keep


@pytest.mark.usefixtures("several_ranks")
def test_a_forward_that_kept_its_heads_holds_no_q_k_v(mesh):
    """keep_forward=True: what the backward reads is kept, so attention holds q, k, v and out
    no longer (a non-leaf q is freed once the caller drops it)."""
    p = mesh.size()
    problem = make_problem(b=1, h=2 * p, h_kv=p, s=8 * p, e=8, layout="bshe", causal=True)
    sched = schedules.get("ulysses", mesh, keep_forward=True)
    leaves = [sched.shard(t, layout="bshe").requires_grad_()
              for t in (problem.q, problem.k, problem.v)]
    q = leaves[0] * 1.0  # made here: only what holds it keeps it
    held = weakref.ref(q)
    out = sdpa_fusion.attention(q, *leaves[1:], causal=True, layout="bshe", kernel="reference",
                                schedule=sched)
    del q
    gc.collect()
    assert held() is None
    out.backward(sched.shard(problem.dout, layout="bshe"))
    assert_matches(problem, [sched.unshard(t, layout="bshe")
                             for t in (out, *(leaf.grad for leaf in leaves))])


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("partition", ["load_balanced", "documents"])
def test_a_second_backward_through_a_keeping_call_is_refused_everywhere(mesh, partition):
    """The kept heads go with the first backward: a second one (retain_graph) is refused on
    every rank with the fix, those that hold q, k, v (whole documents) too, and the next call
    is right."""
    p = mesh.size()
    problem = make_packed([24 * p, 3, 5, 1, 7, 4], h=2 * p, h_kv=p, causal=True)
    sched = schedules.get("ulysses", mesh, keep_forward=True, partition=partition)
    kw = dict(layout="thd", cu_seqlens=problem.cu_seqlens)
    q, k, v = (sched.shard(t, **kw).requires_grad_() for t in (problem.q, problem.k, problem.v))
    dout = sched.shard(problem.dout, **kw)
    out = sdpa_fusion.attention(q, k, v, causal=True, kernel="reference", schedule=sched, **kw)
    out.backward(dout, retain_graph=True)
    with pytest.raises(RuntimeError, match=r"keep_forward=False to backward through a call"):
        out.backward(dout)
    assert_packed_matches(problem, run_packed(sched, problem))


@pytest.mark.usefixtures("several_ranks")
def test_bad_keep_forward_on_one_rank_then_a_correct_call(mesh):
    """keep_forward is True or False; a bad value on rank 0 alone fails on every rank, and a
    rank whose schedule keeps otherwise than the others' is refused at the call."""
    with pytest.raises(ValueError, match=r"keep_forward='yes' must be True"):
        schedules.get("ulysses", mesh, keep_forward="yes" if mesh.rank == 0 else True)
    p = mesh.size()
    problem = make_problem(b=1, h=2 * p, h_kv=p, s=4 * p, e=8, layout="bshe", causal=True)
    good = schedules.get("ulysses", mesh)
    other = schedules.Ulysses(mesh, keep_forward=True) if mesh.rank == 0 else good
    q, k, v = (good.shard(t, layout="bshe") for t in (problem.q, problem.k, problem.v))
    with pytest.raises(ValueError, match=r"differ in schedule.keep_forward"):
        sdpa_fusion.attention(q, k, v, causal=True, layout="bshe", kernel="reference",
                              schedule=other)
    assert_matches(problem, run_schedule(good, problem))
