"""What every schedule moves, counted where torch.distributed sees it (tests/comms.py), against
what its ``describe()`` promises and the formulas of its definition: the bytes this rank
sends and receives over the schedule's process group in a forward and in its backward, the
collectives of each, and nothing anywhere else but the agreement on the control groups.

    mpirun -np 2 python -m pytest tests/distributed/test_traffic.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_traffic.py

On CPU ranks: ring over p2p (``batch_isend_irecv``: one shift per remote step, to the next
rank and from the one before), allgather (``all_gather_into_tensor`` of K and V per head
group, ``reduce_scatter_tensor`` of their sums; packed: one exchange per group, two in
backward), ulysses (``all_to_all_single``, three per group each way; packed: two exchanges
per group, and the sums of K/V heads replicated over the ranks as blocks), head_parallel
(none), hybrid (each dim on its own group, as its ``DimCost`` says). Dense problems in bf16
(BHSE and BSHE), packed ones in fp32 with empty, one-token and uneven sequences.
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from tests.comms import counting

from .conftest import make_problem
from .packed import make_packed
from .test_hybrid import meshes, shapes  # noqa: F401  (the 2-D meshes of this world)

pytestmark = pytest.mark.usefixtures("several_ranks")  # what moves between ranks

LAYOUTS = ["bhse", "bshe", "thd"]
CONTROL_OPS = {"all_reduce", "all_gather_object"}  # the agreement of every call


def problem_for(p: int, layout: str, h: int, h_kv: int, inner: int = 1):
    """(q, k, v, dout, keywords of the call) of a dense bf16 problem or a packed fp32 one."""
    if layout == "thd":
        n = p * inner
        problem = make_packed([3 * n + 1, 0, 1, 5 * n, 2], h=h, h_kv=h_kv, causal=True)
        kw = dict(layout="thd", cu_seqlens=problem.cu_seqlens)
    else:
        problem = make_problem(b=2, h=h, h_kv=h_kv, s=8 * p * inner, e=8, layout=layout,
                               causal=True, dtype=torch.bfloat16)
        kw = dict(layout=layout)
    return problem.q, problem.k, problem.v, problem.dout, kw


def step(sched, q, k, v, dout, kw):
    """(description, what the forward moved, what its backward moved) of one causal call."""
    d = sched.describe(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True, **kw))
    q_l, k_l, v_l = (sched.shard(t, **kw).requires_grad_() for t in (q, k, v))
    dout_l = sched.shard(dout, **kw)
    with counting() as forward:
        out = sdpa_fusion.attention(q_l, k_l, v_l, causal=True, kernel="reference",
                                    schedule=sched, **kw)
    with counting() as backward:
        out.backward(dout_l)
    return d, forward, backward


def assert_only_agreement_besides(seen, mesh, *groups) -> None:
    """Every group ``seen`` was used on is one of ``groups`` or a control group of ``mesh``,
    and those carried the agreement only."""
    data = {g.group_name for g in groups}
    controls = {mesh.control_group(None).group.group_name}
    controls |= {mesh.control_group(name).group.group_name for name in mesh.names}
    assert seen.groups() <= data | controls, str(seen)
    for name in controls - data:
        assert set(seen.ops(name)) <= CONTROL_OPS, str(seen)


def assert_bytes(d, forward, backward, group) -> None:
    """Bytes this rank sent and received over ``group``, forward and backward, as ``d`` says."""
    assert (forward.sent(group), forward.received(group)) == (d.bytes_sent, d.bytes_received), \
        f"forward:\n{forward}"
    assert (backward.sent(group), backward.received(group)) == (
        d.backward_bytes_sent, d.backward_bytes_received), f"backward:\n{backward}"


def calls_of(name: str, layout: str, p: int, groups: int, replicated: bool):
    """{op: calls} of a forward and of its backward on the schedule's group, from its
    definition (``replicated``: a head group holds fewer K/V heads than ranks)."""
    if name == "ring":  # a shift per remote step and group; backward: K/V and the sums
        return ({"batch_isend_irecv": (p - 1) * groups},
                {"batch_isend_irecv": 2 * (p - 1) * groups})
    if name == "allgather" and layout == "thd":  # one exchange of K/V; backward: again, sums
        return {"batch_isend_irecv": groups}, {"batch_isend_irecv": 2 * groups}
    if name == "allgather":  # K and V gathered; backward: again, and dK, dV reduce-scattered
        return ({"all_gather_into_tensor": 2 * groups},
                {"all_gather_into_tensor": 2 * groups, "reduce_scatter_tensor": 2 * groups})
    if layout == "thd":  # ulysses: q, k, v there and out, lse back; backward alike
        sums = {"all_to_all_single": groups} if replicated else {}
        return {"batch_isend_irecv": 2 * groups}, {"batch_isend_irecv": 2 * groups, **sums}
    return {"all_to_all_single": 3 * groups}, {"all_to_all_single": 3 * groups}


# (K/V heads, head groups): "two" K/V heads in two groups are one per group, fewer than the
# ranks (ulysses replicates it and sums its dK/dV as blocks), as is "one" K/V head
KV_GROUPS = [("mha", 1), ("gqa", 1), ("gqa", 2), ("one", 1), ("two", 2)]


@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv, groups", KV_GROUPS, ids=[f"{k}-g{g}" for k, g in KV_GROUPS])
def test_sequence_schedules(mesh, name, layout, kv, groups):
    """Bytes as describe() says, forward and backward; the collectives of the definition;
    the ring's shifts one hop along the ring, and as many as describe()'s remote steps."""
    p = mesh.size()
    h = 4 * p  # two groups of 2P heads: ulysses splits each over the ranks
    h_kv = {"mha": h, "gqa": h // 2, "one": 1, "two": 2}[kv]
    q, k, v, dout, kw = problem_for(p, layout, h, h_kv)
    sched = schedules.get(name, mesh, head_groups=groups)
    d, forward, backward = step(sched, q, k, v, dout, kw)
    assert_bytes(d, forward, backward, sched.group)
    replicated = h_kv // groups < p
    want_forward, want_backward = calls_of(name, layout, p, groups, replicated)
    assert forward.ops(sched.group) == want_forward, str(forward)
    assert backward.ops(sched.group) == want_backward, str(backward)
    for seen in (forward, backward):
        assert_only_agreement_besides(seen, mesh, sched.group)
    if name == "ring":
        assert (d.steps, d.backward_steps) == (p * groups, p * groups)
        assert forward.calls("batch_isend_irecv") == d.steps - groups  # remote steps
        line = mesh.ranks(sched.dim)
        after, before = (line[(sched.index + hops) % p] for hops in (1, -1))
        for seen in (forward, backward):
            to, frm = seen.peers(sched.group)
            assert set(to) == {after} and set(frm) == {before}, str(seen)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_moves_its_kv_block_and_fp32_sums(mesh, layout):
    """The ring's formula, as counted: P - 1 K/V blocks forward; backward the blocks again
    and their fp32 dK/dV sums (P - 1 hops each); packed, the whole local K/V (padding
    included). FLOPs: 1/P of the problem's."""
    p = mesh.size()
    q, k, v, dout, kw = problem_for(p, layout, 4, 2)
    if layout != "thd":
        q, k, v, dout = (t.float() for t in (q, k, v, dout))
    sched = schedules.get("ring", mesh, grad_dtype="fp32")
    d, forward, backward = step(sched, q, k, v, dout, kw)
    local_k = sched.shard(k, **kw)
    kv = 2 * local_k.numel()
    assert forward.sent(sched.group) == d.bytes_sent == (p - 1) * kv * 4
    assert backward.sent(sched.group) == d.backward_bytes_sent == (p - 1) * kv * (4 + 4)
    assert_bytes(d, forward, backward, sched.group)
    if layout != "thd":
        spec = sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True, **kw)
        assert d.flops == pytest.approx(spec.flops() / p)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv", ["mha", "copies"], ids=["mha", "one-kv-head"])
def test_head_parallel_moves_nothing(mesh, layout, kv):
    """No collective on its group, forward or backward (one K/V head: each rank a copy),
    as describe() says: the agreement only."""
    p = mesh.size()
    q, k, v, dout, kw = problem_for(p, layout, 2 * p, 2 * p if kv == "mha" else 1)
    sched = schedules.get("head_parallel", mesh)
    d, forward, backward = step(sched, q, k, v, dout, kw)
    assert (d.bytes_sent, d.backward_bytes_sent) == (0, 0)
    for seen in (forward, backward):
        assert seen.calls(group=sched.group) == 0, str(seen)
        assert_only_agreement_besides(seen, mesh)
    assert forward.calls(group=mesh.control_group().group) > 0  # the call was agreed on


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
@pytest.mark.parametrize("outer", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["bshe", "thd"])
def test_hybrid(meshes, shape, inner, outer, layout):  # noqa: F811
    """Each dim moves over its own group what its ``DimCost`` says, forward and backward
    (packed: sequences in user padding, fp32); inner head_parallel moves nothing."""
    pi, po = shape
    m = meshes(shape)
    if layout == "thd":
        problem = make_packed([2 * pi * po + 1, 0, 1, 4 * pi * po, pi * po + 3], h=2 * pi,
                              h_kv=pi, slack=[1, 2, 0, 3, 0], causal=True, scale=0.4)
        q, k, v, dout = problem.q, problem.k, problem.v, problem.dout
        kw = dict(layout="thd", cu_seqlens=problem.cu_seqlens,
                  cu_seqlens_padded=problem.cu_seqlens_padded)
    else:
        q, k, v, dout, kw = problem_for(po, layout, 2 * pi, pi, inner=pi)
    sched = schedules.get("hybrid", m, inner=inner, outer=outer)
    d, forward, backward = step(sched, q, k, v, dout, kw)
    for part, cost in zip((sched.inner, sched.outer), d.dims):
        assert_bytes(cost.description, forward, backward, part.group)
    for seen in (forward, backward):
        assert_only_agreement_besides(seen, m, sched.inner.group, sched.outer.group)
        if inner == "head_parallel":
            assert seen.calls(group=sched.inner.group) == 0, str(seen)


def test_the_counter_counts_each_entry_point_once(mesh):
    """tests/comms.py itself: each collective once, with the bytes of its docstring; the
    isends and irecvs a batch runs are the batch's; the originals are back after it."""
    import torch.distributed as dist

    p, r, group = mesh.size(), mesh.rank, mesh.group("seq")
    t = torch.ones(4 * p, dtype=torch.float32)  # 16 P bytes
    n = t.numel() * 4
    before = dist.isend, dist.all_gather_into_tensor
    with counting() as seen:
        dist.all_gather_into_tensor(torch.empty(p * t.numel()), t, group=group)
        dist.reduce_scatter_tensor(torch.empty(4), t, group=group)
        dist.all_to_all_single(torch.empty_like(t), t, group=group)
        dist.all_reduce(t.clone(), group=group)
        dist.broadcast(t.clone(), src=mesh.ranks("seq")[0], group=group)
        ops = [dist.P2POp(dist.isend, t, mesh.ranks("seq")[(r + 1) % p], group),
               dist.P2POp(dist.irecv, torch.empty_like(t), mesh.ranks("seq")[(r - 1) % p], group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.barrier(group=group)
    assert (dist.isend, dist.all_gather_into_tensor) == before
    assert seen.ops(group) == {op: 1 for op in (
        "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce",
        "broadcast", "batch_isend_irecv", "barrier")}
    each_way = {"all_gather_into_tensor": (p - 1) * n, "reduce_scatter_tensor": (p - 1) * 16,
                "all_to_all_single": (p - 1) * n // p, "all_reduce": 2 * (p - 1) * n // p,
                "batch_isend_irecv": n}
    for op, nbytes in each_way.items():
        assert (seen.sent(group, op), seen.received(group, op)) == (nbytes, nbytes), op
    root = r == mesh.ranks("seq")[0]
    assert (seen.sent(group, "broadcast"), seen.received(group, "broadcast")) == (
        ((p - 1) * n, 0) if root else (0, n))
    to, frm = seen.peers(group)
    assert to == {mesh.ranks("seq")[(r + 1) % p]: n} and frm == {mesh.ranks("seq")[(r - 1) % p]: n}
