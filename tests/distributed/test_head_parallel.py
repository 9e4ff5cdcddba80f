"""head_parallel and replicated schedules vs the reference (tests/reference.py).

    mpirun -np 2 python -m pytest tests/distributed/test_head_parallel.py
"""

from __future__ import annotations

import re

import pytest
import torch

import schedules
import sdpa_fusion
from tests.reference import assert_close

from .conftest import assert_matches, make_problem, run_schedule


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_head_parallel_matches_reference(mesh, layout, causal, gqa):
    p = mesh.size()
    heads, kv_heads = 2 * p, (p if gqa else 2 * p)
    problem = make_problem(h=heads, h_kv=kv_heads, s=24, layout=layout, causal=causal, scale=0.4)
    assert_matches(problem, run_schedule(schedules.get("head_parallel", mesh), problem))


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_head_parallel_bf16(mesh, layout):
    problem = make_problem(h=2 * mesh.size(), s=40, layout=layout, causal=True, dtype=torch.bfloat16)
    assert_matches(problem, run_schedule(schedules.get("head_parallel", mesh), problem))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_replicated_matches_reference(mesh, causal):
    problem = make_problem(h=4, h_kv=2, s=20, causal=causal)
    assert_matches(problem, run_schedule(schedules.get("replicated", mesh), problem))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_fewer_kv_heads_than_ranks_are_copied(mesh, kv_heads):
    """Each rank gets a copy of the K/V head its query heads use; the copies' gradients are
    the ranks' shares, and their sum is the reference dK/dV."""
    p = mesh.size()
    if p % kv_heads:
        pytest.skip(f"{kv_heads} K/V heads do not divide {p} ranks")
    problem = make_problem(b=1, h=2 * p, h_kv=kv_heads, s=12, causal=True, scale=0.3)
    sched = schedules.get("head_parallel", mesh)
    q, k, v = (sched.shard(t).requires_grad_() for t in (problem.q, problem.k, problem.v))
    assert k.shape[1] == max(kv_heads // p, 1)
    out = sdpa_fusion.attention(q, k, v, causal=True, scale=0.3, schedule=sched, kernel="reference")
    out.backward(sched.shard(problem.dout))
    assert_close(sched.unshard(out), problem.out)
    torch.testing.assert_close(sched.unshard(k, heads=kv_heads, copies="first"), problem.k)
    for got, want in ((k.grad, problem.dk), (v.grad, problem.dv)):
        assert_close(sched.unshard(got, heads=kv_heads, copies="sum"), want)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_replicated_inputs_get_the_whole_gradient(mesh, kv_heads):
    """Inside a replicated model: q, k, v computed alike on every rank (here from replicated
    weights), their heads split with replicated=True and the output's heads gathered; the
    weights' gradients equal the one-process ones on every rank."""
    p = mesh.size()
    if p % kv_heads and kv_heads % p:
        pytest.skip(f"{kv_heads} K/V heads do not divide {p} ranks")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 10, 16, generator=g)
    weights = [torch.randn(16, h * 8, generator=g) / 4 for h in (2 * p, kv_heads, kv_heads)]
    dout = torch.randn(2, 2 * p, 10, 8, generator=g)

    def step(split):
        w = [t.clone().requires_grad_() for t in weights]
        q, k, v = ((x @ wi).unflatten(-1, (-1, 8)).transpose(1, 2) for wi in w)  # BSHE views
        if split is None:
            out = sdpa_fusion.attention(q, k, v, causal=True, kernel="reference")
        else:
            local = [split.shard(t, replicated=True) for t in (q, k, v)]
            out = split.unshard(sdpa_fusion.attention(*local, causal=True, kernel="reference",
                                                      schedule=split))
        (out * dout).sum().backward()
        return out, [wi.grad for wi in w]

    out, grads = step(schedules.get("head_parallel", mesh))
    want_out, want_grads = step(None)
    assert_close(out, want_out)
    for name, got, want in zip("qkv", grads, want_grads):
        assert_close(got, want, msg=f"w_{name}")


@pytest.mark.usefixtures("several_ranks")
def test_mismatched_local_shapes_raise_on_every_rank(mesh):
    """Rank 0 passes a different sequence length: every rank raises the same error."""
    sched = schedules.get("head_parallel", mesh)
    s = 16 if mesh.rank == 0 else 8
    q = k = v = torch.randn(1, 2, s, 16)
    with pytest.raises(ValueError, match=r"needs the same call on every rank .* differ in q_len"):
        sdpa_fusion.attention(q, k, v, schedule=sched, kernel="reference")


@pytest.mark.usefixtures("several_ranks")
def test_bad_input_on_one_rank_raises_on_every_rank(mesh):
    """Rank 0 claims the wrong layout: every rank raises, naming rank 0 and the argument."""
    sched = schedules.get("head_parallel", mesh)
    q = torch.randn(1, 8, 2, 16)
    if mesh.rank == 0:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match=r"rank 0: q .* does not have the layout 'bhse'"):
        sdpa_fusion.attention(q, q.contiguous(), q.contiguous(), schedule=sched, kernel="reference",
                              layout="bhse")


def test_dtensor_in_dtensor_out(mesh):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    problem = make_problem(h=2 * mesh.size(), s=16, causal=True)
    sched = schedules.get("head_parallel", mesh)
    q, k, v = (distribute_tensor(t, mesh.torch_mesh, [Shard(1)]).requires_grad_()
               for t in (problem.q, problem.k, problem.v))
    out = sdpa_fusion.attention(q, k, v, causal=True, schedule=sched, kernel="reference")
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    out.backward(distribute_tensor(problem.dout, mesh.torch_mesh, [Shard(1)]))
    assert_close(out.full_tensor(), problem.out)
    assert_close(q.grad.full_tensor(), problem.dq)
    assert_close(k.grad.full_tensor(), problem.dk)


def test_dtensor_with_other_placements_is_refused(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    problem = make_problem(b=1, h=2 * mesh.size(), s=8 * mesh.size(), e=8)
    sched = schedules.get("head_parallel", mesh)
    q = distribute_tensor(problem.q, mesh.torch_mesh, [Shard(2)])
    with pytest.raises(ValueError, match=r"q has placements \[Shard\(dim=2\)\] but schedule "
                                         r"'head_parallel' needs \[Shard\(dim=1\)\]"):
        sdpa_fusion.attention(q, q, q, schedule=sched, kernel="reference")


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("heads_per_rank", [1, 2])
def test_unshard_of_copies_is_exact_or_asks(mesh, kv_heads, heads_per_rank):
    """Fewer K/V heads than ranks: unshard without keywords gives k, v and out exactly (with
    one query head per rank too, where out and a copy's gradient both gather P heads); the
    gradient of a copy raises the same ValueError on every rank naming heads= and copies=,
    and with them the gradients of q, k, v are the reference gradients of the full tensors."""
    p = mesh.size()
    if kv_heads >= p or p % kv_heads:
        pytest.skip(f"{kv_heads} K/V heads are not fewer than {p} ranks, dividing them")
    problem = make_problem(b=1, h=heads_per_rank * p, h_kv=kv_heads, s=12, causal=True, scale=0.3)
    sched = schedules.get("head_parallel", mesh)
    q, k, v = (sched.shard(t).requires_grad_() for t in (problem.q, problem.k, problem.v))
    out = sdpa_fusion.attention(q, k, v, causal=True, scale=0.3, schedule=sched, kernel="reference")
    out.backward(sched.shard(problem.dout))
    for got, want in ((out, problem.out), (k, problem.k), (v, problem.v)):
        assert_close(sched.unshard(got), want)
    ambiguous = [k.grad, v.grad] + ([q.grad] if heads_per_rank == 1 else [])
    for grad in ambiguous:
        with pytest.raises(ValueError) as raised:
            sched.unshard(grad)
        messages = mesh.agree(str(raised.value))
        assert len(set(messages)) == 1, messages
        assert re.search(rf"unshard cannot tell .* Pass heads={kv_heads}, copies='sum' for the "
                         rf"gradient .* copies='first' for values .* or heads={p} ", messages[0])
    dq = sched.unshard(q.grad, **({"heads": p} if heads_per_rank == 1 else {}))
    assert_close(dq, problem.dq)
    for name, got, want in (("dk", k.grad, problem.dk), ("dv", v.grad, problem.dv)):
        assert_close(sched.unshard(got, heads=kv_heads, copies="sum"), want, msg=name)


@pytest.mark.usefixtures("several_ranks")
def test_fewer_query_heads_than_ranks_are_refused_on_every_rank(mesh):
    """Query heads are split, never copied: q of one head sharded over P ranks is a
    ValueError on every rank (not P copies gathered as P heads); describe says so too."""
    p = mesh.size()
    problem = make_problem(b=1, h=1, h_kv=1, s=8)
    sched = schedules.get("head_parallel", mesh)
    q, k, v = (sched.shard(t) for t in (problem.q, problem.k, problem.v))
    fewer = rf"q is a copy of one head of a tensor of 1 heads, not a multiple of the {p} ranks"
    with pytest.raises(ValueError, match=rf"every rank: {fewer} of schedule 'head_parallel'"):
        sdpa_fusion.attention(q, k, v, schedule=sched, kernel="reference")
    torch.testing.assert_close(sched.unshard(q), problem.q, rtol=0, atol=0)
    spec = sdpa_fusion.AttentionSpec(1, p + 1, 1, 8, 8, 8)
    with pytest.raises(ValueError, match=rf"the problem's {p + 1} query heads, not a multiple"):
        sched.describe(spec)
    good = make_problem(h=2 * p, s=8)
    assert_matches(good, run_schedule(sched, good))
