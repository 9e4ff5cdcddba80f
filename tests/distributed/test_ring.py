"""Ring attention vs the reference, its buffers and its kernel calls (its mask cases and
errors of pure planning: tests/test_plans.py; its traffic: test_traffic.py).

    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_ring.py
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from schedules import heads
from schedules.comm import Pending
from sdpa_fusion.kernels.reference import ReferenceKernel

from .conftest import assert_matches, make_problem, run_schedule

PARTITIONS = ["load_balanced", "contiguous", "striped"]


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_ring_matches_reference(mesh, partition, layout, causal, gqa):
    p = mesh.size()
    problem = make_problem(b=1, h=4, h_kv=2 if gqa else 4, s=8 * p, e=8, layout=layout,
                           causal=causal, scale=0.5)
    sched = schedules.get("ring", mesh, partition=partition)
    assert_matches(problem, run_schedule(sched, problem))


def test_ring_index_map_non_causal(mesh):
    p = mesh.size()
    perm = torch.randperm(8 * p, generator=torch.Generator().manual_seed(3))
    sched = schedules.get("ring", mesh, partition=perm.view(p, -1).tolist())
    problem = make_problem(b=1, h=2, s=8 * p, e=8, layout="bshe")
    assert_matches(problem, run_schedule(sched, problem))


def test_ring_bf16(mesh):
    problem = make_problem(b=1, h=4, s=16 * mesh.size(), e=16, causal=True, dtype=torch.bfloat16)
    sched = schedules.get("ring", mesh)
    assert_matches(problem, run_schedule(sched, problem))


def test_odd_local_length_rejected_on_every_rank(mesh):
    """A local length that no load-balanced sharding gives raises on every rank."""
    sched = schedules.get("ring", mesh)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=f"must be divisible by {2 * mesh.size()} for load_balanced"):
        sdpa_fusion.attention(q, q, q, causal=True, kernel="reference", schedule=sched)


def test_causal_with_unordered_index_map_rejected(mesh):
    p = mesh.size()
    rows = torch.arange(4 * p).flip(0).view(p, -1).tolist()
    sched = schedules.get("ring", mesh, partition=rows)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="causal attention needs each rank's tokens in increasing order"):
        sdpa_fusion.attention(q, q, q, causal=True, kernel="reference", schedule=sched)



def test_copy_engine_transport_needs_cuda(mesh):
    """On CPU ranks the copy-engine transport is refused on every rank before any transfer;
    ``auto`` falls back to send/receive and matches the reference."""
    if mesh.device.type == "cuda":
        pytest.skip("CPU ranks only: GPU ranks run tests/gpu_distributed")
    p = mesh.size()
    problem = make_problem(b=1, h=2, s=8 * p, e=8, causal=True)
    q, k, v = (schedules.get("ring", mesh).shard(t) for t in (problem.q, problem.k, problem.v))
    with pytest.raises(ValueError, match="transport='copy_engine' cannot run here: it needs CUDA "
                                         "tensors, got cpu tensors; use transport='p2p'"):
        sdpa_fusion.attention(q, k, v, causal=True, kernel="reference",
                              schedule=schedules.get("ring", mesh, transport="copy_engine"))
    auto = schedules.get("ring", mesh, transport="auto")
    assert_matches(problem, run_schedule(auto, problem))
    assert auto.mover(mesh.device).name == "p2p"


def test_ring_reuses_its_buffers_across_calls_and_sizes(mesh):
    """Consecutive calls with growing and shrinking blocks, forward and backward, each match
    the reference (slots are reused or grown between calls)."""
    p = mesh.size()
    sched = schedules.get("ring", mesh)
    for s, h in ((8 * p, 2), (16 * p, 4), (8 * p, 2)):
        problem = make_problem(b=1, h=h, s=s, e=8, causal=True, layout="bshe")
        assert_matches(problem, run_schedule(sched, problem))


class _Recording(ReferenceKernel):
    """The reference kernel, noting each backward call (its K/V heads) in ``events``."""

    name = "recording"

    def __init__(self, events):
        self.events = events

    def backward(self, dout, q, k, v, *args, **kwargs):
        self.events.append(("backward", k.shape[1], k.shape[2]))
        return super().backward(dout, q, k, v, *args, **kwargs)


@pytest.mark.parametrize("head_groups", ["auto", 1], ids=["auto", "one"])
def test_backward_of_one_group_runs_two_the_first_on_its_own_block_first(mesh, head_groups,
                                                                          monkeypatch):
    """With one head group (auto) on blocks of at least MIN_GROUP_WORK rows x heads, the
    backward runs two: the first works on its own block (no wait) while the first remote
    block travels, then on the remote blocks; the second takes its own block last. Exact
    either way; head_groups=1 keeps one group, own block last (its first call waits)."""
    p, events = mesh.size(), []
    monkeypatch.setattr(heads, "MIN_GROUP_WORK", 4 * 8)  # 4 heads x 8 rows: one group, large
    original = Pending.wait
    monkeypatch.setattr(Pending, "wait", lambda self: (events.append(("wait",)),
                                                       original(self))[1])
    problem = make_problem(b=1, h=4, h_kv=2, s=8 * p, e=8, causal=True)
    sched = schedules.get("ring", mesh, head_groups=head_groups)
    layout = problem.layout
    q, k, v = (sched.shard(t, layout=layout).requires_grad_()
               for t in (problem.q, problem.k, problem.v))
    out = sdpa_fusion.attention(q, k, v, causal=True, scale=problem.scale, layout=layout,
                                kernel=_Recording(events), schedule=sched)
    events.clear()
    out.backward(sched.shard(problem.dout, layout=layout))
    calls = [e for e in events if e[0] == "backward"]
    results = tuple(sched.unshard(t, layout=layout) for t in (out.detach(), q.grad, k.grad, v.grad))
    assert_matches(problem, results)
    split = head_groups == "auto"
    assert len(calls) == (2 * p if split else p)
    assert {heads for _, heads, _ in calls} == {1 if split else 2}
    assert (events[0][0] == "backward") == split  # no wait before it
    assert not split or calls[0][2] == k.shape[2]  # the own block: all local keys


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("grad_dtype", ["auto", "fp32"])
def test_rows_a_sum_leaves_unwritten_are_never_read(mesh, monkeypatch, partition, grad_dtype):
    """Every buffer a ring sends from starts as NaN: a rank that writes only its call's keys
    of a one-hop dK/dV sum (P = 2) leaves the other rows NaN, and the gradients stay exact
    only if nobody reads them (above two ranks every row is written)."""
    from schedules import transport

    def nan_filled(self, device):
        numel = sum(torch.Size(s).numel() for s in self.shapes)
        flat = torch.full((numel,), float("nan"), dtype=self.dtype, device=device)
        return transport.views(flat, self.shapes, self.layout)

    monkeypatch.setattr(transport.RingData, "empty", nan_filled)
    problem = make_problem(b=1, h=4, s=8 * mesh.size(), e=8, causal=True, scale=0.5)
    sched = schedules.get("ring", mesh, partition=partition, grad_dtype=grad_dtype)
    assert_matches(problem, run_schedule(sched, problem))


class _RowsSummingKernel(ReferenceKernel):
    """The reference kernel with ``query_rows``, as a kernel that sums dQ over calls inside
    (FA4's ``QueryRows`` on Hopper) does it: each call's dQ added into one fp32 tensor of the
    rows, written once at the end; it takes calls whose rows start on an even row only."""

    def __init__(self):
        self.spans = []  # the spans of every query_rows it accepted

    def query_rows(self, q, dout, out, lse, *, scale, spans):
        if any(start % 2 for start, _, _ in spans):
            return None
        self.spans.append(spans)
        return _SummedRows(self, q, dout, out, lse, scale)


class _SummedRows:
    def __init__(self, kernel, q, dout, out, lse, scale):
        self.kernel, self.rows_args, self.scale = kernel, (dout, q, out, lse), scale
        self.acc = torch.zeros(q.shape, dtype=torch.float32)

    def call(self, rows, k, v, dk, dv, *, causal):
        dout, q, out, lse = (t[:, :, rows] for t in self.rows_args)
        dq_c, dk_c, dv_c = self.kernel.backward(dout, q, k, v, out, lse, causal=causal,
                                                scale=self.scale)
        self.acc[:, :, rows] += dq_c
        dk.copy_(dk_c)
        dv.copy_(dv_c)

    def finish(self, dq):
        return dq.copy_(self.acc)


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_kernel_that_sums_dq_over_calls(mesh, partition, layout, gqa):
    """A kernel that sums dQ over a head group's calls itself (``Kernel.query_rows``) gets
    every call whose rows it takes (all of them, or none: then the ring sums), in the
    ring's exact results."""
    p = mesh.size()
    kernel = _RowsSummingKernel()
    problem = make_problem(b=2, h=4, h_kv=2 if gqa else 4, s=6 * p, e=8, layout=layout,
                           causal=True, scale=0.5)
    sched = schedules.get("ring", mesh, partition=partition)
    assert_matches(problem, run_schedule(sched, problem, kernel=kernel))
    if partition == "load_balanced":  # calls on rows 0:6 or 3:6; the latter are refused
        assert all(start % 2 == 0 for spans in kernel.spans for start, _, _ in spans)
        assert any(mesh.agree(bool(kernel.spans)))
