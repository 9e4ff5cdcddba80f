"""The plans the sequence schedules make for the runner (``schedules/runner.py``), checked as
data on every rank of meshes of 2, 4 and 8 (``VirtualMesh``, data-less tensors): transfers
and arrivals alternate, calls read a block only while one is current, every result is
opened and finished once per head group, and a backward runs exactly the calls its forward
ran. That the runner computes the right numbers from them is the distributed suite's
business (tests/distributed, against the fp32 reference); that it allocates what
``describe`` says, tests/distributed/test_memory.py.

Run: pytest -q tests/test_runner.py
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from schedules import dry_run, runner
from sdpa_fusion import VirtualMesh

SCHEDULES = [("ring", {}), ("ring", {"partition": "contiguous"}), ("ring", {"head_groups": 2}),
             ("ring", {"partition": "documents"}), ("allgather", {}),
             ("allgather", {"head_groups": 2}), ("allgather", {"partition": "documents"}),
             ("ulysses", {}), ("ulysses", {"transport": "copy_engine"})]


def problems(p: int):
    """(name, global spec): dense causal, full, GQA and windowed problems, packed batches."""
    dense = dict(batch=1, heads=4 * p, kv_heads=2 * p, q_len=32 * p, kv_len=32 * p, head_dim=16)
    cu = (0, *torch.tensor([20 * p, 3, 0, 7, 5 * p + 1]).cumsum(0).tolist())
    packed = {**dense, "q_len": cu[-1], "kv_len": cu[-1], "layout": "thd", "cu_seqlens": cu}
    spec = sdpa_fusion.AttentionSpec
    return [("causal", spec(**dense, causal=True)), ("full", spec(**dense)),
            ("gqa", spec(**{**dense, "kv_heads": p}, causal=True)),
            ("window", spec(**dense, causal=True, window=(9, 0))),
            ("packed", spec(**packed, causal=True)),
            ("packed-window", spec(**packed, window=(6, 2)))]


def plans(name: str, options: dict, p: int):
    """(where, forward plan, backward plan) of every rank and problem."""
    for what, spec in problems(p):
        for rank in range(p):
            sched = schedules.get(name, VirtualMesh((p,), ("seq",), rank=rank), **options)
            runs = [(sched, spec)]
            if spec.layout.is_varlen and getattr(sched, "by_documents", lambda *_: False)(
                    spec.cu_seqlens, spec.cu_seqlens_padded):
                # whole documents: local calls, no plan; each group's cut ones on a twin
                runs = [(sched.twin(group), sched._cut_global(spec, group))
                        for group, _, _ in sched.local_spec(spec).packing.cuts]
            for twin, planned in runs:
                local, (q, k, _, _) = dry_run.local_problem(twin, planned)
                try:
                    twin.validate(local)
                except ValueError:  # a problem this schedule refuses (tests/test_describe.py)
                    continue
                q, k = runner.blocks(local, q, k)
                yield ((name, options, p, what, rank), twin.plan(local, q, k, backward=False),
                       twin.plan(local, q, k, backward=True))


def assert_well_formed(plan: runner.Plan, where) -> list:
    """The plan's invariants; returns the calls it runs."""
    pending = current = False  # a transfer in flight; a block the calls may read
    opened, finished, calls = [], [], []
    landing, sums = set(), 0
    for op in plan.ops:
        if isinstance(op, (runner.Send, runner.Gather)):
            assert not pending, (where, "two transfers in flight", op)
            pending = True
        elif isinstance(op, runner.KV):
            assert 0 <= op.group < plan.groups, (where, op)
            if op.arrives:
                assert pending, (where, "a block arrives that nothing sent", op)
                pending = False
            current = True
        elif isinstance(op, runner.Drop):
            current = False
        elif isinstance(op, (runner.Fold, runner.Grads, runner.Attend)):
            assert current, (where, "calls on no block", op)
            calls += op.calls if not isinstance(op, runner.Attend) else [op.call]
            if isinstance(op, runner.Grads) and op.into in (runner.NEW, runner.ARRIVING):
                sums += 1
        elif isinstance(op, (runner.Open, runner.OpenDq)):
            assert len(opened) == len(finished), (where, "opened twice", op)
            opened.append(op.group)
        elif isinstance(op, (runner.Finish, runner.FinishDq)):
            finished.append(opened[-1])
        elif isinstance(op, runner.SendSums):
            assert sums == 1, (where, "sums sent that no call made", op)
            sums = 0
        elif isinstance(op, runner.StartScatter):
            landing.add(op.group)
        elif isinstance(op, runner.Land):
            landing.remove(op.group)
    assert not pending and not landing and sums == 0, (where, "left in flight")
    assert isinstance(plan.ops[-1], (runner.Finish, runner.FinishDq, runner.Scatter,
                                     runner.Land, runner.AddSums, runner.SendSums)), where
    if any(isinstance(op, (runner.Open, runner.OpenDq)) for op in plan.ops):
        assert sorted(opened) == sorted(finished) == list(range(plan.groups)), (where, opened)
    return calls


@pytest.mark.parametrize("p", [2, 4, 8], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("name, options", SCHEDULES,
                         ids=[f"{n}-{'-'.join(map(str, o.values())) or 'default'}"
                              for n, o in SCHEDULES])
def test_plans_are_well_formed_and_backward_runs_the_forward_calls(name, options, p):
    planned = 0
    for where, forward, backward in plans(name, options, p):
        ran = assert_well_formed(forward, where)
        differentiated = assert_well_formed(backward, where)
        assert {_key(c) for c in ran} == {_key(c) for c in differentiated}, where
        planned += 1
    assert planned


@pytest.mark.parametrize("p", [2, 4, 8], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("name, options", SCHEDULES,
                         ids=[f"{n}-{'-'.join(map(str, o.values())) or 'default'}"
                              for n, o in SCHEDULES])
def test_beside_runs_while_a_transfer_is_in_flight(name, options, p):
    """``with_beside`` (the whole documents' calls under partition ``documents``) adds its
    pieces in order, each right before a wait while a transfer is in flight, the last before
    the plan's last wait, none before a wait that a call since the transfer started hides
    (but the last), and changes nothing else."""
    for where, *both in plans(name, options, p):
        for plan in both:
            for pieces in (1, 2, 3):
                ops = runner.with_beside(plan, pieces).ops
                assert [op for op in ops if not isinstance(op, runner.Beside)] == list(plan.ops)
                at = [i for i, op in enumerate(ops) if isinstance(op, runner.Beside)]
                assert [ops[i].index for i in at] == list(range(pieces)), where
                waiting = [i for i, op in enumerate(ops) if runner.waits(op)]
                flying, hidden = _in_flight(ops)
                for i in at:
                    before = next(j for j in range(i, len(ops))
                                  if not isinstance(ops[j], runner.Beside))
                    assert before in waiting and flying[i], (where, ops)
                    assert not hidden[before] or before == waiting[-1], (where, ops)
                if pieces > 1:
                    assert at[-1] == waiting[-1] - 1, where


def test_beside_delays_no_relay_of_the_ring_forward():
    """The ring's forward hides each shift behind the calls before it and relays each block
    on: the pieces run before its last block, which no rank relays."""
    spec = sdpa_fusion.AttentionSpec(1, 2, 2, 64, 64, 16, causal=True)
    sched = schedules.get("ring", VirtualMesh((4,), ("seq",), rank=1), head_groups=1)
    local, (q, k, _, _) = dry_run.local_problem(sched, spec)
    ops = runner.with_beside(sched.plan(local, q, k, backward=False), 2).ops
    names = [type(op).__name__ for op in ops]
    assert names[-5:] == ["Beside", "Beside", "KV", "Fold", "Finish"]
    assert "Send" not in names[names.index("Beside"):]


def test_beside_hides_ulysses_first_and_last_exchanges():
    """Packed ulysses: the first piece after the first exchange starts, the second while
    the last comes home."""
    spec = sdpa_fusion.AttentionSpec(1, 4, 4, 12, 12, 8, layout="thd", cu_seqlens=(0, 5, 12),
                                     causal=True)
    sched = schedules.get("ulysses", VirtualMesh((2,), ("seq",), rank=0))
    local, (q, k, _, _) = dry_run.local_problem(sched, spec)
    for backward in (False, True):
        plan = sched.plan(local, *runner.blocks(local, q, k), backward=backward)
        ops = runner.with_beside(plan, 2).ops
        assert ops[:3] == (runner.Gather(0), runner.Beside(0), runner.KV(0, arrives=True))
        assert ops[-2:] == (runner.Beside(1), runner.Land(plan.groups - 1))


def _in_flight(ops) -> tuple[list[bool], list[bool]]:
    """Per op, whether a transfer started before it is still in flight when it runs, and
    whether a kernel call ran since the latest transfer started."""
    pending = landing = sums = 0
    flying, hidden, called = [], [], True
    for op in ops:
        flying.append(bool(pending or landing or sums))
        hidden.append(called)
        if isinstance(op, (runner.Send, runner.Gather, runner.StartScatter, runner.SendSums)):
            called = False
        elif isinstance(op, (runner.Fold, runner.Grads, runner.Attend)):
            called = True
        if isinstance(op, (runner.Send, runner.Gather)):
            pending += 1
        elif isinstance(op, runner.KV) and op.arrives:
            pending -= 1
        elif isinstance(op, runner.StartScatter):
            landing += 1
        elif isinstance(op, runner.Land):
            landing -= 1
        elif isinstance(op, runner.SendSums):
            sums += 1
        elif isinstance(op, runner.AddSums) or (isinstance(op, runner.Grads)
                                                 and op.into == runner.ARRIVING):
            sums -= 1
    return flying, hidden


def _key(call):
    """A call by value where it has one (dense calls), else by identity (packed calls are
    made once per packing)."""
    try:
        return hash(call), call
    except TypeError:
        return id(call)


def test_the_ring_plan_is_the_one_the_runner_docstring_shows():
    """P = 3, one head group, no mask: the own block leaves, then each block arrives and
    travels on while it is used, except the last."""
    spec = sdpa_fusion.AttentionSpec(1, 2, 2, 48, 48, 16)
    sched = schedules.get("ring", VirtualMesh((3,), ("seq",), rank=1), head_groups=1)
    local, (q, k, _, _) = dry_run.local_problem(sched, spec)
    ops = sched.plan(local, q, k, backward=False).ops
    assert [type(op).__name__ for op in ops] == [
        "Send", "KV", "Open", "Fold", "KV", "Send", "Fold", "KV", "Fold", "Finish"]
    assert ops[0] == runner.Send(1, group=0) and ops[5] == runner.Send(1)
    assert [op.arrives for op in ops if isinstance(op, runner.KV)] == [False, True, True]
    assert [op.stream[2] for op in ops if isinstance(op, runner.Fold)] == [1, 0, 2]  # owners
