"""allgather schedule vs the single-process reference, its errors and its byte counts.

    mpirun -np 2 python -m pytest tests/distributed/test_allgather.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_allgather.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import schedules
import sdpa_fusion
from schedules.allgather import MAX_RUNS, gathered_calls, packed_plan, runs
from schedules.calls import row_index

from .conftest import assert_matches, make_problem, run_schedule, schedule_with
from .packed import assert_packed_matches, make_packed, run_packed

PARTITIONS = ["contiguous", "load_balanced", "striped", "index_map"]


def index_map(s: int, p: int, causal: bool):
    """Non-causal: a random permutation split into rows. Causal: rank r holds chunks r and
    r + P of 2P (increasing, two runs: a map allgather can mask)."""
    if causal:
        c = s // (2 * p)
        return [list(range(r * c, (r + 1) * c)) + list(range((r + p) * c, (r + p + 1) * c))
                for r in range(p)]
    return torch.randperm(s, generator=torch.Generator().manual_seed(7)).view(p, -1).tolist()


def schedule(mesh, partition: str, s: int, causal: bool):
    return schedule_with("allgather", mesh, partition, lambda: index_map(s, mesh.size(), causal))


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_matches_reference(mesh, partition, layout, causal, kv_heads):
    p = mesh.size()
    s = 8 * p
    problem = make_problem(b=2, h=4, h_kv=kv_heads, s=s, e=8, layout=layout, causal=causal, scale=0.3)
    if causal and partition == "striped" and p > 1:  # one run of tokens per stripe: refused
        with pytest.raises(ValueError, match=r"partition 'striped' gives a rank \d+ runs"):
            run_schedule(schedule(mesh, partition, s, causal), problem)
        return
    assert_matches(problem, run_schedule(schedule(mesh, partition, s, causal), problem))


@pytest.mark.parametrize("partition", ["load_balanced", "striped"])
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_keys_outnumber_queries(mesh, partition, layout):
    p = mesh.size()
    problem = make_problem(b=1, h=4, h_kv=2, s=4 * p, s_kv=12 * p, e=8, layout=layout)
    sched = schedules.get("allgather", mesh, partition=partition)
    assert_matches(problem, run_schedule(sched, problem))


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_bf16(mesh, layout):
    problem = make_problem(b=1, h=4, h_kv=2, s=16 * mesh.size(), e=16, layout=layout, causal=True,
                           dtype=torch.bfloat16)
    sched = schedules.get("allgather", mesh, partition="load_balanced")
    assert_matches(problem, run_schedule(sched, problem), torch.bfloat16)


@pytest.mark.parametrize(
    "indices, causal, want",
    [
        ([0, 1, 2, 3], True, []),                               # rank 0, contiguous
        ([8, 9, 10, 11], True, [(slice(0, 4), 8)]),             # rank 2, contiguous
        ([0, 1, 14, 15], True, [(slice(2, 4), 12)]),            # rank 0, load_balanced P=4
        ([6, 7, 8, 9], True, [(slice(0, 4), 6)]),               # rank 3: its two chunks meet
        ([2, 3, 12, 13], True, [(slice(0, 2), 2), (slice(2, 4), 10)]),  # rank 1
        ([5, 0, 9, 3], False, [(slice(0, 4), 12)]),             # any order without causal
    ],
)
def test_gathered_calls(indices, causal, want):
    assert gathered_calls(torch.tensor(indices), 16, 4, causal) == want


def test_runs():
    assert runs(torch.tensor([0, 1, 2, 7, 8, 12])) == [(0, 3), (3, 5), (5, 6)]


@pytest.mark.usefixtures("several_ranks")
def test_causal_striped_is_refused(mesh):
    sched = schedules.get("allgather", mesh, partition="striped")
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"partition 'striped' gives a rank 8 runs .* Use "
                                         r"partition='load_balanced' or 'contiguous'"):
        sdpa_fusion.attention(q, q, q, causal=True, schedule=sched, kernel="reference")


def test_sequence_not_divisible(mesh):
    p = mesh.size()
    sched = schedules.get("allgather", mesh, partition="load_balanced")
    q = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match=rf"sequence length {3 * p} must be divisible by {2 * p} "
                                         rf"for load_balanced sharding over {p} ranks; pad"):
        sdpa_fusion.attention(q, q, q, schedule=sched, kernel="reference")
    with pytest.raises(ValueError, match=rf"pad the sequence to a multiple of {2 * p}"):
        sched.shard(torch.randn(1, 2, 2 * p + 1, 16))


def test_causal_unordered_index_map_is_refused(mesh):
    p = mesh.size()
    rows = [list(range(r * 4, (r + 1) * 4))[::-1] for r in range(p)]
    sched = schedules.get("allgather", mesh, partition=rows)
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="needs each rank's tokens in increasing order"):
        sdpa_fusion.attention(q, q, q, causal=True, schedule=sched, kernel="reference")


def _formula(spec, p, rank, partition):
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


@pytest.mark.parametrize("partition", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_describe_formula(mesh, partition, causal):
    p = mesh.size()
    spec = sdpa_fusion.AttentionSpec(2, 8, 2, 64 * p, 64 * p, 64, causal=causal)
    d = schedules.get("allgather", mesh, partition=partition).describe(spec)
    forward, backward, flops = _formula(spec, p, mesh.rank, partition)
    assert (d.bytes_sent, d.bytes_received) == (forward, forward)
    assert (d.backward_bytes_sent, d.backward_bytes_received) == (backward, backward)
    assert d.flops == pytest.approx(flops)
    assert d.backward_flops == pytest.approx(2.5 * flops)
    if partition == "load_balanced" or not causal:
        assert d.flops == pytest.approx(spec.flops() / p)


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("groups", [1, 2])
def test_describe_matches_communicator(mesh, layout, groups):
    """Bytes as described; per head group two all-gathers (K, V) forward, and backward two
    more and two reduce-scatters (dK, dV)."""
    p = mesh.size()
    problem = make_problem(b=1, h=4, h_kv=2, s=8 * p, e=8, layout=layout, causal=True,
                           dtype=torch.bfloat16)
    sched = schedules.get("allgather", mesh, partition="load_balanced", head_groups=groups)
    q, k, v = (sched.shard(t, layout=layout).requires_grad_() for t in (problem.q, problem.k, problem.v))
    d = sched.describe(sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, layout=layout)))
    sched.comm.stats.reset()
    out = sdpa_fusion.attention(q, k, v, causal=True, layout=layout, kernel="reference", schedule=sched)
    stats = sched.comm.stats
    assert (stats.bytes_sent, stats.bytes_received, stats.transfers) == (
        d.bytes_sent, d.bytes_received, 2 * groups)
    out.backward(sched.shard(problem.dout, layout=layout))
    assert (stats.bytes_sent, stats.bytes_received, stats.transfers) == (
        d.bytes_sent + d.backward_bytes_sent, d.bytes_received + d.backward_bytes_received,
        6 * groups)


@pytest.mark.parametrize("kv", ["mha", "gqa"])
@pytest.mark.parametrize("window", [None, (3, 0)], ids=["causal", "window"])
def test_packed_in_four_groups_matches_reference(mesh, kv, window):
    """Packed K/V gathered into regions used in turn (the next group's lands while one is
    attended) and dK/dV sums landing behind the next group's own calls, over four head
    groups: empty, one-token and unevenly split sequences, forward and backward exact."""
    p = mesh.size()
    problem = make_packed([3 * p + 1, 0, 1, 5 * p, 2], h=8, h_kv=8 if kv == "mha" else 4,
                          causal=True, window=window, scale=0.3)
    sched = schedules.get("allgather", mesh, head_groups=4)
    assert_packed_matches(problem, run_packed(sched, problem))


def test_packed_runs_that_see_the_same_keys_share_a_call(mesh):
    """At P = 2 a rank's two runs of every sequence see the same keys of the other rank
    (rank 1: chunk 0 before both its chunks), so its gathered keys make one call, and each
    key gets one contribution to its dK/dV; above, at most MAX_RUNS calls."""
    p = mesh.size()
    sched = schedules.get("allgather", mesh)
    cu = torch.tensor([0, 37, 37, 38, 38 + 16 * p, 38 + 16 * p + 5])
    for rank in range(p):
        own, calls = packed_plan(sched.pack(cu, rank=rank), causal=True)
        assert len(calls) <= (1 if p == 2 else MAX_RUNS)
        for call in calls:  # every key once per call
            keys = row_index(call.keys, p * sched.pack(cu, rank=rank).tokens)
            assert len(set(keys.tolist())) == len(keys)


@pytest.mark.parametrize("kv", ["mha", "gqa"])
def test_packed_sums_in_bf16_give_the_numbers_of_fp32_sums(mesh, monkeypatch, kv):
    """bf16 packed calls at P = 2: the gathered calls' key sets are disjoint, so each dK/dV
    sum is one kernel gradient and travels in bf16 with nothing rounded: the gradients equal
    those of fp32 sums. Above P = 2 (or under a window) the sums are fp32."""
    p = mesh.size()
    problem = make_packed([3 * p + 1, 0, 1, 5 * p, 2], h=4, h_kv=4 if kv == "mha" else 2,
                          causal=True, dtype=torch.bfloat16, scale=0.3)
    sched = schedules.get("allgather", mesh)
    spec = _local_bf16_spec(sched, problem.cu_seqlens, 4, 4 if kv == "mha" else 2, causal=True)
    assert sched._sums_dtype(spec) == (torch.bfloat16 if p == 2 else torch.float32)
    auto = run_packed(sched, problem)
    wide = schedules.get("allgather", mesh)
    monkeypatch.setattr(wide, "_sums_dtype", lambda local: torch.float32)
    for a, b in zip(auto, run_packed(wide, problem)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, (3, 0)),
                                            (False, (2, 5))],
                         ids=["causal", "full", "causal-window", "full-window"])
def test_packed_bf16_sums_dtype_agrees_on_every_rank(mesh, causal, window):
    """Every rank takes the same dtype for the dK/dV sums, whose exchanges size their regions
    by it: each rank plans every rank's calls (window bands included; a window's plan was
    once this rank's calls for every rank, and ranks disagreed), and the bf16 results match
    the reference."""
    p = mesh.size()
    problem = make_packed([3 * p + 1, 0, 1, 5 * p, 2], h=4, causal=causal, window=window,
                          dtype=torch.bfloat16, scale=0.3)
    sched = schedules.get("allgather", mesh)
    spec = _local_bf16_spec(sched, problem.cu_seqlens, 4, 4, causal=causal, window=window)
    assert len(set(mesh.agree(str(sched._sums_dtype(spec))))) == 1
    assert_packed_matches(problem, run_packed(sched, problem), rtol=2e-2, atol=2e-2)


@settings(max_examples=30, derandomize=True, database=None, deadline=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(lengths=st.lists(st.integers(0, 13), min_size=1, max_size=5), causal=st.booleans(),
       window=st.one_of(st.none(), st.tuples(st.integers(0, 6), st.integers(0, 6))))
def test_packed_sums_dtype_is_the_same_on_every_rank(mesh, lengths, causal, window):
    """Random packings, causal or not, with or without a window: every rank derives the same
    dtype for the dK/dV sums (every rank draws the same examples)."""
    cu = torch.tensor([0, *torch.tensor([1, *lengths]).cumsum(0).tolist()])
    window = None if window is None else (window[0], 0 if causal else window[1])
    sched = schedules.get("allgather", mesh)
    spec = _local_bf16_spec(sched, cu, 2, 2, causal=causal, window=window)
    dtypes = mesh.agree(str(sched._sums_dtype(spec)))
    assert len(set(dtypes)) == 1, f"lengths {[1, *lengths]}: {dtypes}"


def _local_bf16_spec(sched, cu_seqlens, heads: int, kv_heads: int, *, causal: bool,
                     window=None) -> sdpa_fusion.AttentionSpec:
    """This rank's local spec of a bf16 packed call on ``cu_seqlens`` (head dim 8)."""
    local = sched.pack(cu_seqlens)
    return sdpa_fusion.AttentionSpec(1, heads, kv_heads, local.tokens, local.tokens, 8,
                                     torch.bfloat16, causal=causal, layout="thd", packing=local,
                                     window=window)
