"""Random sequences of calls on one schedule object equal the reference (hypothesis):
schedule x partition x layout x causal x GQA x batch, heads, length, head dim and scale that
change from one call to the next.

    mpirun -np 2 python -m pytest tests/distributed/test_random_calls.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_random_calls.py

Every rank draws the same examples (derandomized, no shrinking); each call's verdict is
gathered before asserting, so a failure on one rank fails every rank instead of hanging.
"""

from __future__ import annotations

import datetime

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import schedules  # noqa: E402
import sdpa_fusion  # noqa: E402

from tests import reference  # noqa: E402

from .conftest import make_problem  # noqa: E402

SCHEDULES = {  # name -> partitions it takes (None: it splits heads)
    "ring": ["load_balanced", "contiguous", "striped", "index_map"],
    "allgather": ["load_balanced", "contiguous", "striped", "index_map"],
    "ulysses": ["load_balanced", "contiguous", "striped"],
    "head_parallel": [None],
}


@pytest.fixture(scope="module")
def short_mesh(mesh):
    if mesh.size() == 1:
        pytest.skip("runs under mpirun")
    return sdpa_fusion.init_mesh((-1,), ("seq",), timeout=datetime.timedelta(seconds=120))


@st.composite
def sessions(draw):
    """(schedule name, partition, fixed length multiple or None, calls)."""
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    partition = draw(st.sampled_from(SCHEDULES[name]))
    fixed = draw(st.integers(1, 2)) if partition == "index_map" else None
    call = st.fixed_dictionaries(dict(
        layout=st.sampled_from(["bhse", "bshe"]), causal=st.booleans(), gqa=st.booleans(),
        b=st.integers(1, 2), heads=st.integers(1, 2), length=st.integers(1, 3),
        e=st.sampled_from([8, 16]), scale=st.sampled_from([None, 0.5]), seed=st.integers(0, 99),
    ))
    return name, partition, fixed, draw(st.lists(call, min_size=2, max_size=3))


def _allowed_causal(name: str, partition) -> bool:
    """Index maps reorder tokens; allgather makes one call per run (striped: too many)."""
    return partition != "index_map" and not (name == "allgather" and partition == "striped")


@settings(max_examples=60, derandomize=True, database=None, deadline=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(session=sessions())
def test_random_calls_on_one_schedule(short_mesh, session):
    name, partition, fixed, calls = session
    mesh, p = short_mesh, short_mesh.size()
    options = {}
    if partition == "index_map":
        perm = torch.randperm(2 * p * fixed, generator=torch.Generator().manual_seed(fixed))
        options["partition"] = perm.view(p, -1).tolist()
    elif partition is not None:
        options["partition"] = partition
    sched = schedules.get(name, mesh, **options)
    for c in calls:
        h = 2 * p * c["heads"]
        s = 2 * p * (fixed or c["length"])
        causal = c["causal"] and _allowed_causal(name, partition)
        problem = make_problem(b=c["b"], h=h, h_kv=h // 2 if c["gqa"] else h, s=s, e=c["e"],
                               layout=c["layout"], causal=causal, scale=c["scale"], seed=c["seed"])
        verdicts = mesh.agree(_mismatch(sched, problem))
        assert verdicts == [None] * mesh.world_size, f"{name} {partition} {c}: {verdicts}"


def _mismatch(sched, problem) -> str | None:
    """None when this rank's out, dq, dk, dv equal the reference's shards, else what differs."""
    shard = lambda t: sched.shard(t, layout=problem.layout)  # noqa: E731
    q, k, v = (shard(t).requires_grad_() for t in (problem.q, problem.k, problem.v))
    out = sdpa_fusion.attention(q, k, v, causal=problem.causal, scale=problem.scale,
                                layout=problem.layout.value, kernel="reference", schedule=sched)
    out.backward(shard(problem.dout))
    for what, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                               (problem.out, problem.dq, problem.dk, problem.dv)):
        try:
            reference.assert_close(got, shard(want), torch.float32)
        except AssertionError as e:
            return f"{what}: {e}"
    return None
