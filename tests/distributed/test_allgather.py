"""allgather schedule vs the reference, its errors, and the dtype its dK/dV sums travel in
(its plans and describe() are checked in tests/test_plans.py and tests/test_describe.py, its
traffic in test_traffic.py).

    mpirun -np 2 python -m pytest tests/distributed/test_allgather.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_allgather.py
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from tests.test_plans import local_bf16_spec

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
    assert_matches(problem, run_schedule(sched, problem))


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


@pytest.mark.parametrize("kv", ["mha", "gqa"])
def test_packed_sums_in_bf16_give_the_numbers_of_fp32_sums(mesh, monkeypatch, kv):
    """bf16 packed calls at P = 2: the gathered calls' key sets are disjoint, so each dK/dV
    sum is one kernel gradient and travels in bf16 with nothing rounded: the gradients equal
    those of fp32 sums. Above P = 2 (or under a window) the sums are fp32."""
    p = mesh.size()
    problem = make_packed([3 * p + 1, 0, 1, 5 * p, 2], h=4, h_kv=4 if kv == "mha" else 2,
                          causal=True, dtype=torch.bfloat16, scale=0.3)
    sched = schedules.get("allgather", mesh, partition="load_balanced")
    spec = local_bf16_spec(sched, problem.cu_seqlens, 4, 4 if kv == "mha" else 2, causal=True)
    assert sched._sums_dtype(spec) == (torch.bfloat16 if p == 2 else torch.float32)
    auto = run_packed(sched, problem)
    wide = schedules.get("allgather", mesh, partition="load_balanced")
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
    sched = schedules.get("allgather", mesh, partition="load_balanced")
    spec = local_bf16_spec(sched, problem.cu_seqlens, 4, 4, causal=causal, window=window)
    assert len(set(mesh.agree(str(sched._sums_dtype(spec))))) == 1
    assert_packed_matches(problem, run_packed(sched, problem))


