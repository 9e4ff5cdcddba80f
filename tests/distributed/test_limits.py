"""Kernel limits under every schedule: no call reaches a kernel past its limits, and the split
calls give the reference's results on the whole problem.

    mpirun -np 2 python -m pytest tests/distributed/test_limits.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_limits.py

The kernel is ``Bounded`` (the reference kernel trusted with few elements per call): a call
of one head over the whole sequence fits, anything more of a rank's problem does not, so
every schedule's calls split (head groups, batch elements, packed sequences) or copy views.
"""

from __future__ import annotations

import pytest

import schedules
import sdpa_fusion

from ..bounded import Bounded
from .conftest import assert_matches, make_problem, run_schedule
from .packed import assert_packed_matches, make_packed, run_packed

NAMES = ["ring", "allgather", "ulysses", "head_parallel"]


def _bounded(elements: int, rows_per_sequence: int = 0) -> Bounded:
    kernel = Bounded(elements, rows_per_sequence)
    kernel.name = "bounded"
    return kernel


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_calls_stay_inside_the_limits(mesh, name, layout, causal):
    p = mesh.size()
    problem = make_problem(b=2, h=2 * p, h_kv=p, s=8 * p, e=8, layout=layout, causal=causal)
    kernel = _bounded(8 * p * 8)  # one head of one batch element over the whole sequence
    results = run_schedule(schedules.get(name, mesh), problem, kernel=kernel)
    assert_matches(problem, results)
    assert kernel.calls and not kernel.past, kernel.past[:3]
    if p > 1:  # a rank's whole problem is more than the limit: its calls were split
        assert max(size for *_, size in kernel.calls) <= kernel.limits.elements


@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses"])
def test_packed_calls_stay_inside_the_limits(mesh, name):
    p = mesh.size()
    lengths = [3 * p + 1, 1, 0, 5 * p, 2 * p + 3, 4]
    problem = make_packed(lengths, h=2 * p, h_kv=p, e=8, causal=True)
    kernel = _bounded((5 * p + 2) * 8, rows_per_sequence=2)  # one head of the longest
    results = run_packed(schedules.get(name, mesh), problem, kernel=kernel)
    assert_packed_matches(problem, results)
    assert kernel.calls and not kernel.past, kernel.past[:3]


def test_a_call_no_split_fits_fails_on_every_rank_then_a_good_one_runs(mesh):
    """One head of the sequence past the limit is refused when the call is planned, on every
    rank (here the bad kernel is everyone's: the limit is a property of the kernel)."""
    p = mesh.size()
    sched = schedules.get("allgather", mesh)
    problem = make_problem(b=1, h=p, s=8 * p, e=8, causal=True)
    q, k, v = (sched.shard(t) for t in (problem.q, problem.k, problem.v))
    with pytest.raises(ValueError, match=r"kernel 'bounded' takes at most .* no split"):
        sdpa_fusion.attention(q, k, v, causal=True, schedule=sched, kernel=_bounded(8 * p * 8 - 8))
    assert_matches(problem, run_schedule(sched, problem, kernel=_bounded(8 * p * 8)))


@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
def test_hybrid_calls_stay_inside_the_limits(mesh, inner):
    from .test_hybrid import SHAPES

    p = mesh.size()
    shape = SHAPES[0]
    sched = schedules.get("hybrid", sdpa_fusion.init_mesh(shape, ("heads", "seq")), inner=inner)
    problem = make_problem(b=2, h=2 * p, h_kv=p, s=8 * p, e=8, layout="bshe", causal=True)
    kernel = _bounded(8 * p * 8)
    assert_matches(problem, run_schedule(sched, problem, kernel=kernel))
    assert kernel.calls and not kernel.past, kernel.past[:3]
