"""Packed sequences (THD) under every schedule vs the reference run sequence by sequence on
the full problem: causal and not, GQA, lengths 0, 1 and not divisible by 2P, user padding.

    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_thd.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import schedules

from .packed import assert_packed_matches, make_packed, refill, run_packed

SCHEDULES = [("ring", "load_balanced"), ("ring", "contiguous"), ("ring", "striped"),
             ("allgather", "load_balanced"), ("allgather", "contiguous"),
             ("ulysses", "load_balanced"), ("ulysses", "striped"), ("head_parallel", None)]

# Every rank draws the same examples (derandomized, no database) and none is shrunk (a
# shrink on one rank alone would desynchronize the collectives).
SAME_ON_EVERY_RANK = dict(derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
                          deadline=None, suppress_health_check=list(HealthCheck))


def schedule(mesh, name: str, partition: str | None):
    options = {} if partition is None else dict(partition=partition)
    return schedules.get(name, mesh, **options)


def lengths_for(p: int) -> list[int]:
    """Not a multiple of 2P, empty, one token, a multiple of 2P, short."""
    return [2 * p + 1, 0, 1, 4 * p, p + 3]


@pytest.mark.parametrize("name, partition", SCHEDULES, ids=[f"{n}-{p}" for n, p in SCHEDULES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("padded", [False, True], ids=["cu_seqlens", "cu_seqlens_padded"])
def test_matches_reference(mesh, name, partition, causal, gqa, padded):
    """With cu_seqlens_padded the call takes this rank's LocalPacking, else the global
    cu_seqlens."""
    p = mesh.size()
    problem = make_packed(lengths_for(p), h=2 * p, h_kv=p if gqa else 2 * p,
                          slack=[1, 2, 0, 3, 0] if padded else None, causal=causal, scale=0.4)
    results = run_packed(schedule(mesh, name, partition), problem, local=padded)
    assert_packed_matches(problem, results)


@st.composite
def packed_problems(draw, p: int):
    n = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, 3 * p + 2), min_size=n, max_size=n))
    slack = draw(st.none() | st.lists(st.integers(0, 3), min_size=n, max_size=n))
    if sum(lengths) + sum(slack or []) == 0:
        lengths[0] = 1
    return make_packed(lengths, h=2 * p, h_kv=draw(st.sampled_from([1, p, 2 * p])), slack=slack,
                       causal=draw(st.booleans()), scale=0.5, seed=draw(st.integers(0, 99)))


@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses", "head_parallel"])
def test_random_packings_match_reference(mesh, name):
    p = mesh.size()
    sched = schedules.get(name, mesh)

    @settings(max_examples=4, **SAME_ON_EVERY_RANK)
    @given(packed_problems(p))
    def check(problem):
        if name == "head_parallel" and problem.k.shape[1] % p:
            return  # K/V heads split over ranks
        assert_packed_matches(problem, run_packed(sched, problem))

    check()


def test_bf16(mesh):
    p = mesh.size()
    problem = make_packed([4 * p + 3, 1, 6 * p], h=2 * p, h_kv=p, e=16, causal=True,
                          dtype=torch.bfloat16)
    results = run_packed(schedules.get("ring", mesh), problem)
    assert_packed_matches(problem, results)


def test_calls_reused_across_calls_and_packings(mesh):
    """Alternating packings on one schedule: each call matches (kernel calls cached per packing)."""
    p = mesh.size()
    sched = schedules.get("ring", mesh)
    for lengths in ([3 * p, 1], [p, 2 * p + 1, 5], [3 * p, 1]):
        problem = make_packed(lengths, h=2, causal=True)
        assert_packed_matches(problem, run_packed(sched, problem))


@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses", "head_parallel"])
@pytest.mark.parametrize("padded", [False, True], ids=["cu_seqlens", "cu_seqlens_padded"])
def test_cu_seqlens_as_lists(mesh, name, padded):
    """Python lists of ints give what the tensors give (shard, pack, attention, unshard),
    which is the reference."""
    p = mesh.size()
    problem = make_packed(lengths_for(p), h=2 * p, h_kv=p, causal=True, scale=0.4,
                          slack=[1, 2, 0, 3, 0] if padded else None)
    sched = schedules.get(name, mesh)
    as_tensors = run_packed(sched, problem)
    listed = dataclasses.replace(problem, cu_seqlens=problem.cu_seqlens.tolist(),
                                 cu_seqlens_padded=None if problem.cu_seqlens_padded is None
                                 else problem.cu_seqlens_padded.tolist())
    as_lists = run_packed(sched, listed)
    assert_packed_matches(problem, as_lists)
    for got, want in zip(as_lists, as_tensors):
        assert torch.equal(got, want)


@pytest.mark.parametrize("how", ["data", "numpy"])
@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses", "head_parallel"])
def test_a_refilled_cu_seqlens_buffer_gives_its_new_packing(mesh, name, how):
    """A data loader refills one cu_seqlens buffer in place without a version bump (through
    .data, or a NumPy array sharing its memory): every call uses the packing it holds now."""
    p = mesh.size()
    packings = [make_packed(lengths, h=2 * p, h_kv=p, causal=True, seed=3)
                for lengths in ([4 * p + 1, 3 * p], [p, 6 * p + 1], [4 * p + 1, 3 * p])]
    array = packings[0].cu_seqlens.numpy().copy() if how == "numpy" else None
    buffer = torch.from_numpy(array) if array is not None else packings[0].cu_seqlens.clone()
    sched = schedules.get(name, mesh)
    for problem in packings:
        refill(buffer, array, problem.cu_seqlens.tolist())
        assert_packed_matches(problem, run_packed(sched, dataclasses.replace(problem,
                                                                             cu_seqlens=buffer)))
