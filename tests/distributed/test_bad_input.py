"""Bad input on one rank or on every rank, on a fresh schedule or after an agreed call: every
rank raises the same ValueError (or, for a difference that is itself a valid call on every
rank, every rank gets the right numbers), and the next correct call on the same mesh and
schedule equals the reference. The cases are in bad_calls.py.

    mpirun -np 2 python -m pytest tests/distributed/test_bad_input.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_bad_input.py

The mesh of these tests has a short timeout: a case that hangs fails with MeshTimeout instead
of stalling the suite. Above 4 ranks the suite is left out (CI time; the cases do not depend
on the rank count beyond 2 and 4).
"""

from __future__ import annotations

import datetime
import re

import pytest

import schedules
import sdpa_fusion

from .bad_calls import CASES, Ctx, check, good_call

TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture(scope="module")
def short_mesh(mesh):
    if mesh.size() == 1 or mesh.size() > 4:
        pytest.skip("runs under mpirun -np 2 and -np 4")
    return sdpa_fusion.init_mesh((-1,), ("seq",), timeout=TIMEOUT)


def test_there_are_enough_cases():
    assert len(CASES) * 4 >= 100


@pytest.mark.parametrize("when", ["fresh", "after_a_call"])
@pytest.mark.parametrize("who", ["one_rank", "every_rank"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(short_mesh, case, who, when):
    mesh = short_mesh
    ctx = Ctx(mesh, schedules.get(case.schedule, mesh, **case.options(mesh.size())), dict(case.base))
    if when == "after_a_call":
        check(good_call(ctx.sched, ctx.problem()), ctx.problem())
    last = mesh.world_size - 1
    action = case.act(ctx, who == "every_rank" or mesh.rank == last)
    if case.error is not None and (who == "one_rank" or case.all_error):
        with pytest.raises(ValueError) as raised:
            action()
        messages = mesh.agree(str(raised.value))
        assert len(set(messages)) == 1, f"the ranks raised different errors: {messages}"
        assert re.search(case.error, messages[0]), messages[0]
        if who == "one_rank":
            assert f"rank {last}" in messages[0], messages[0]
    else:
        action()
    check(good_call(ctx.sched, ctx.problem()), ctx.problem())
