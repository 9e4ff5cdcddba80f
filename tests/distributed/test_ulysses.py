"""ulysses schedule vs the reference (tests/reference.py) and its errors (its describe():
tests/test_describe.py; its traffic: test_traffic.py).

    mpirun -np 2 python -m pytest tests/distributed/test_ulysses.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_ulysses.py
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion

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


