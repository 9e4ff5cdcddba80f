"""One runner for the plans of the sequence schedules.

A sequence schedule is a planner: for this rank's local problem it returns a ``Plan``, the
ordered ops of a forward or a backward as data, and ``forward`` / ``backward`` run any plan:

    plan = schedule.plan(spec, *runner.blocks(spec, q, k), backward=False)
    out, lse = runner.forward(plan, q, k, v, spec, kernel, mover)

The ops of a ring forward over P = 3 ranks, one head group, at rank r (block j: rank j's):

    Send(hops=1, group=0)        this rank's own block starts for rank r + 1
    KV(group=0, arrives=False)   the calls read the own block ...
    Open(group=0, blocks=3)      ... into the merged result of the group's rows
    Fold(calls, stream)          ... (the kernel calls on the block)
    KV(group=0, arrives=True)    wait for the block of rank r - 1
    Send(hops=1)                 ... and pass it on while it is used
    Fold(calls, stream)
    KV(group=0, arrives=True)    the block of rank r - 2
    Fold(calls, stream)
    Finish()

Forward folds calls into a merged result (Open, Fold, Finish); backward sums dQ (OpenDq ...
FinishDq) and sends a block's dK/dV where ``Grads.into`` says. Rings of K/V blocks and dK/dV
sums go through the schedule's transport (``schedules.transport``), other transfers through
the plan's ``transfers``. ``Beside`` ops run work a caller gives (partition ``documents``:
the whole documents' calls) where a transfer is in flight (``with_beside``). The runner knows
no schedule: the order of the ops is the schedule.
``schedules.dry_run`` runs the same code on data-less tensors for ``describe()``'s memory.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from sdpa_fusion.kernels.base import layout_of
from sdpa_fusion.merge import Merged

from . import heads
from .calls import (Sum, add_rows, as_block, as_packed, backward_calls, call_grads, dq_sum_of,
                    fold_calls, gradients, outputs, put_rows, zero_outside)
from .transport import RingData


# ---- ops ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Send:
    """Start moving K/V ``hops`` ranks on: the own block of ``group``, or (None) the last."""

    hops: int
    group: int | None = None


@dataclasses.dataclass(frozen=True)
class Gather:
    """Start gathering every rank's K/V of head group ``group`` (the plan's ``transfers``)."""

    group: int


@dataclasses.dataclass(frozen=True)
class KV:
    """The block the next calls read: the own of ``group``, or (``arrives``) the one in flight."""

    group: int
    arrives: bool = False


@dataclasses.dataclass(frozen=True)
class Drop:
    """No call reads the current K/V block any more (what it holds may go)."""


@dataclasses.dataclass(frozen=True)
class Attend:
    """Attend the arrived block, which carries its own queries, by ``call`` (None: no query
    sees a key); the results go home by the next Scatter or StartScatter."""

    call: object
    stream: tuple


@dataclasses.dataclass(frozen=True)
class Open:
    """Forward: start the merged result of ``group``'s rows, at most ``blocks`` calls each."""

    group: int
    blocks: int


@dataclasses.dataclass(frozen=True)
class Fold:
    """Forward: fold the kernel ``calls`` on the current block into the merged result."""

    calls: tuple
    stream: tuple


@dataclasses.dataclass(frozen=True)
class Finish:
    """Forward: the merged result is complete (written into out and lse)."""


@dataclasses.dataclass(frozen=True)
class OpenDq:
    """Backward: start ``group``'s dQ sum over ``calls`` (or a sum of ``contributions``)."""

    group: int
    calls: tuple = ()
    contributions: int | None = None


# where a Grads op puts the calls' dK/dV
OWN = "own"  # this rank's gradients of the group (zero where no call reached)
NEW = "new"  # new sums (that a SendSums sends)
ARRIVING = "arriving"  # added into the sums in flight (waits for them; a SendSums sends them on)
PARTS = "parts"  # kept as (keys, gradient) parts of the group, for its Scatter or Land
SUMS = "sums"  # summed per key of the block into new sums in the plan's dtype (Scatter them)


@dataclasses.dataclass(frozen=True)
class Grads:
    """Backward: the kernel ``calls`` on the current block, their dQ into the dQ sum, their
    dK/dV ``into`` one of the places above (NEW without ``zero_rest``: only the first call's
    keys are written, nobody reads the rest)."""

    calls: tuple
    stream: tuple
    into: str
    zero_rest: bool = True


@dataclasses.dataclass(frozen=True)
class SendSums:
    """Backward: start moving the dK/dV sums (NEW or ARRIVING) ``hops`` ranks on."""

    hops: int


@dataclasses.dataclass(frozen=True)
class AddSums:
    """Backward: add the sums in flight (waits) into this rank's dK/dV of ``group``."""

    group: int


@dataclasses.dataclass(frozen=True)
class Scatter:
    """Send ``group``'s results (SUMS and PARTS, or Attend's) home; write what comes (waits)."""

    group: int


@dataclasses.dataclass(frozen=True)
class StartScatter:
    """Start sending the results of head group ``group`` home (``Land`` writes them)."""

    group: int


@dataclasses.dataclass(frozen=True)
class Land:
    """Wait for ``group``'s StartScatter; write what came (with its PARTS) into the outputs."""

    group: int


@dataclasses.dataclass(frozen=True)
class Beside:
    """Run the caller's ``index``-th piece of other work (partition ``documents``: a part of
    the whole documents' kernel calls) while the transfers started before it are in flight."""

    index: int


@dataclasses.dataclass(frozen=True)
class FinishDq:
    """Backward: the dQ sum is complete (written into dq)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """One rank's ops for a forward or a backward over ``groups`` head groups. ``travel`` =
    (start, rows) of a block that travel (None: all); ``kv_slots`` of the K/V ring; ``sums``
    = (dtype, ring slots) of the dK/dV sums; ``carried``: the rows of this rank's block that
    received sums carry (None: all); ``transfers``: gathers and scatters (``begin``,
    ``gather``, ``scatter``, ``start_scatter``, ``land``; ``begin`` is given the call's
    ``kept``: what a forward leaves there, its backward needs not move again)."""

    ops: tuple
    groups: int
    travel: tuple[int, int] | None = None
    kv_slots: int = 0
    sums: tuple[torch.dtype, int] | None = None
    carried: slice | None = None
    transfers: object = None

    def count(self, *kinds) -> int:
        """How many of the plan's ops are of one of ``kinds``."""
        return sum(isinstance(op, kinds) for op in self.ops)

    def kv_bytes(self, spec, rows: int, dtype: torch.dtype) -> int:
        """Bytes of one head group's K and V (or dK/dV sums) of ``rows`` rows in ``dtype``."""
        return (2 * spec.batch * (spec.kv_heads // self.groups) * rows * spec.head_dim
                * dtype.itemsize)


def plans_of(schedule, spec) -> tuple[Plan, Plan]:
    """``schedule``'s forward and backward plans on this rank for the global ``spec``."""
    local, rows = schedule.local_spec(spec), schedule.local_tokens(spec)
    q, k = (torch.empty(spec.batch, h, rows, spec.head_dim, device="meta")
            for h in (spec.heads, spec.kv_heads))
    return tuple(schedule.plan(local, q, k, backward=b) for b in (False, True))


def waits(op) -> bool:
    """Whether ``op`` waits for a transfer in flight."""
    return (isinstance(op, KV) and op.arrives) or isinstance(op, (Land, AddSums)) or \
        (isinstance(op, Grads) and op.into == ARRIVING)


def with_beside(plan: Plan, pieces: int) -> Plan:
    """``plan`` running ``pieces`` pieces of other work where no kernel call hides a transfer:
    the first before the first wait with no call since a transfer started (Ulysses' first
    exchange, the ring's first block in backward), else before the last wait; the last before
    the last wait (Ulysses' last exchange, the dK/dV sums coming home, the last K/V block:
    nothing waits on a relay behind it); any others spread over the unhidden waits between."""
    waiting, exposed, called = [], [], True
    for i, op in enumerate(plan.ops):
        if waits(op):
            waiting.append(i)
            if not called:
                exposed.append(i)
        if isinstance(op, (Send, Gather, StartScatter, SendSums)):
            called = False
        elif isinstance(op, (Fold, Grads, Attend)):
            called = True
    if not waiting:
        waiting = [0]
    first = exposed[0] if exposed else waiting[-1]
    places = sorted({*exposed, waiting[-1]} - set(range(first)))
    at = collections.defaultdict(list)
    for j in range(pieces):
        at[places[j * (len(places) - 1) // max(pieces - 1, 1)]].append(Beside(j))
    ops = [o for i, op in enumerate(plan.ops) for o in (*at[i], op)]
    return dataclasses.replace(plan, ops=tuple(ops))


# ---- the runner -----------------------------------------------------------------------------
def forward(plan: Plan, q, k, v, spec, kernel, mover, dropout=None, *, out=None, lse=None,
            beside=(), kept=None):
    """(out, lse) of the forward ``plan`` on this rank's q, k, v (``beside``: the callables
    its Beside ops run; ``kept``: where the plan's transfers leave what backward reuses)."""
    packed = spec.layout.is_varlen
    if packed:
        q, k, v = (as_block(t) for t in (q, k, v))
    out, lse = outputs(q, out, lse, packed)
    run = _Run(plan, dict(q=q, k=k, v=v, out=out, lse=lse), spec, kernel, mover, dropout,
               beside, kept)
    (run.kv,) = run.rings((k.dtype, plan.kv_slots))
    merged = None
    for op in plan.ops:
        if isinstance(op, Open):
            g = run.groups[op.group]
            merged = Merged(g.of_q(out), g.of_q(lse), op.blocks)
        elif isinstance(op, Fold):
            g = run.group
            fold_calls(op.calls, kernel, merged, g.of_q(q), *run.block, spec.softmax_scale,
                       run.streams(op.stream))
        elif isinstance(op, Finish):
            merged.finish()
        else:
            run.do(op)
    return (as_packed(out) if packed else out), lse


def backward(plan: Plan, dout, q, k, v, out, lse, spec, kernel, mover, dropout=None, *, dq=None,
             dk=None, dv=None, beside=(), kept=None):
    """(dq, dk, dv) of the backward ``plan`` on this rank's tensors and the global out, lse
    (``beside``: the callables its Beside ops run; ``kept``: what the forward's transfers
    left)."""
    packed = spec.layout.is_varlen
    if packed:
        dout, q, k, v, out = (as_block(t) for t in (dout, q, k, v, out))
    dq, dk, dv = gradients((q, k, v), (dq, dk, dv), packed)
    run = _Run(plan, dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv),
               spec, kernel, mover, dropout, beside, kept)
    run.kv, sums = run.rings((k.dtype, plan.kv_slots), plan.sums or (None, 0))
    dq_sum = outgoing = pending = args = None

    def targets(group: int):
        g = run.groups[group]
        return g.of_kv(dk), g.of_kv(dv)

    for op in plan.ops:
        needs_block = isinstance(op, Grads) or (isinstance(op, OpenDq) and
                                                op.contributions is None)
        if needs_block and args is None:  # the current block's
            g = run.group
            args = (g.of_q(dout), g.of_q(q), *run.block, g.of_q(out), g.of_q(lse),
                    spec.softmax_scale)
        if isinstance(op, OpenDq):
            target = run.groups[op.group].of_q(dq)
            dq_sum = dq_sum_of(kernel, target, op.calls, args, dropout) \
                if op.contributions is None else Sum(target, op.contributions)
        elif isinstance(op, Grads):
            step = _Step(op.calls, kernel, dq_sum, args, run.streams(op.stream))
            if op.into == PARTS:
                run.parts[run.group.index] = step.parts()
            elif op.into == SUMS:
                run.results = step.sums(plan.sums[0])
            elif op.into == OWN:
                step.write(targets(run.group.index))
            elif op.into == NEW:
                outgoing = sums.data.empty(k.device)
                step.write(outgoing, zero_rest=op.zero_rest)
            else:
                outgoing = step.add_into(pending)
            del step  # nothing of the block stays referenced past its calls
        elif isinstance(op, SendSums):
            pending = sums.shift(outgoing, hops=op.hops)
            outgoing = None  # the transport holds it until it has left
        elif isinstance(op, AddSums):  # only the carried rows, when the plan has them
            for target, summed in zip(targets(op.group), pending.wait()):
                if plan.carried is None:
                    run.sent(target).add_(summed)
                else:
                    add_rows(run.sent(target), plan.carried, summed[:, :, plan.carried])
        elif isinstance(op, FinishDq):
            dq_sum.finish()
        else:
            run.do(op)
            args = None
    if packed:
        dq, dk, dv = (as_packed(t) for t in (dq, dk, dv))
    return dq, dk, dv


class _Run:
    """What the ops of one call share: tensors, head groups, blocks, results and parts."""

    def __init__(self, plan: Plan, tensors: dict, spec, kernel, mover, dropout, beside, kept):
        self.plan, self.tensors, self.spec, self.kernel = plan, tensors, spec, kernel
        self.mover, self.dropout, self.beside = mover, dropout, beside
        q, k, v = tensors["q"], tensors["k"], tensors["v"]
        self.groups = heads.groups_of(plan.groups, q.shape[1], k.shape[1])
        self.own = [(g.of_kv(k), g.of_kv(v)) for g in self.groups]
        self.leaving = [tuple(self.sent(t) for t in block) for block in self.own]
        self.group = self.block = self.pending = self.kv = self.results = None
        self.parts, self.landing = {}, {}
        if plan.transfers is not None:  # before the first op: what they keep for the call
            keeping = {} if kept is None else {"kept": kept}  # only a keeping schedule's
            plan.transfers.begin(tensors, self.groups, "dout" in tensors, **keeping)

    def sent(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of a block ``t`` that travel."""
        if self.plan.travel is None:
            return t
        start, rows = self.plan.travel
        return t.narrow(2, start, rows)

    def rings(self, *dtypes_and_slots):
        """One ring per (dtype, slots) carrying a group's two travelling tensors (or None)."""
        wanted = [(dtype, slots) for dtype, slots in dtypes_and_slots if slots]
        if not wanted:
            return [None] * len(dtypes_and_slots)
        k = self.tensors["k"]
        shape = tuple(self.leaving[0][0].shape)
        datas = [RingData((shape, shape), dtype, layout_of(k), slots) for dtype, slots in wanted]
        made = iter(self.mover.rings(datas, k.device))
        return [next(made) if slots else None for _, slots in dtypes_and_slots]

    def do(self, op) -> None:
        """Run an op that forward and backward share."""
        transfers = self.plan.transfers
        if isinstance(op, Gather):
            self.pending = transfers.gather(self.groups[op.group])
        elif isinstance(op, Send):
            block = self.block if op.group is None else self.leaving[op.group]
            self.pending = self.kv.shift(block, hops=op.hops)
        elif isinstance(op, Drop):
            self.block = None
        elif isinstance(op, Beside):
            self.beside[op.index]()
        elif isinstance(op, KV):
            self.group = self.groups[op.group]
            if op.arrives:  # what the transfer held goes with it
                self.block, self.pending = tuple(self.pending.wait()), None
            else:
                self.block = self.own[op.group]
        elif isinstance(op, Attend):
            self.results = self._attend(op)
        elif isinstance(op, Scatter):
            transfers.scatter(self.groups[op.group], self.parts.pop(op.group, None),
                              self.results)
            self.results = None
        elif isinstance(op, StartScatter):
            self.landing[op.group] = transfers.start_scatter(self.groups[op.group],
                                                             self.results)
            self.results = None
        elif isinstance(op, Land):
            transfers.land(self.groups[op.group], self.landing.pop(op.group),
                           self.parts.pop(op.group, None))
        else:
            raise TypeError(f"not an op of this runner: {op!r}")

    def _attend(self, op) -> list[torch.Tensor]:
        """``op.call`` on the arrived block: (q, k, v) -> [out, lse [..., 1]], (dout, q, k,
        v, out, lse [..., 1]) -> [dq, dk, dv]; zeros (lse -inf) when the call is None."""
        block, call, scale = self.block, op.call, self.spec.softmax_scale
        stream = None if self.dropout is None else self.dropout.stream(*op.stream)
        if len(block) == 3:
            q = block[0]
            if call is None:  # no real token anywhere
                return [torch.zeros_like(q),
                        torch.full((*q.shape[:3], 1), float("-inf"), device=q.device)]
            out, lse = call.forward(self.kernel, *block, scale, stream)
            return [out, lse.unsqueeze(-1)]
        if call is None:
            return [torch.zeros_like(t) for t in block[1:4]]
        *inputs, lse = block
        return list(call.backward(self.kernel, *inputs, lse.squeeze(-1).contiguous(), scale,
                                  stream))

    def streams(self, stream: tuple):
        """Call i's dropout stream ``(*stream, i)``; None without dropout."""
        if self.dropout is None:
            return None
        return lambda call: self.dropout.stream(*stream, call)


class _Step:
    """The kernel calls of a backward op on one K/V block; their dQ goes into ``dq_sum``."""

    def __init__(self, calls, kernel, dq_sum: Sum, args, streams):
        self.calls, self.kernel, self.dq_sum = calls, kernel, dq_sum
        self.args, self.streams = args, streams

    def add_into(self, pending):
        """The sums ``pending`` brings plus the calls' dK/dV."""
        grads = self._grads(0) if self.calls else ()
        summed = pending.wait()
        for acc, grad in zip(summed, grads):
            add_rows(acc, self.calls[0].keys, grad)
        del grads
        self._add_rest(summed)
        return summed

    def parts(self):
        """[dK parts, dV parts] of the calls, each part (key rows, gradient)."""
        kept = [[], []]
        for i, call in enumerate(self.calls):
            for part, grad in zip(kept, self._grads(i)):
                part.append((call.keys, grad))
        return kept

    def sums(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The calls' dK and dV summed per key of the block, in ``dtype`` (fp32: every call
        adds; else the calls' key sets are disjoint, one gradient per key)."""
        sums = [torch.empty_like(t, dtype=dtype) for t in self.args[2:4]]
        contributions = len(self.calls) if dtype == torch.float32 else 1
        backward_calls(self.calls, self.kernel, self.dq_sum, self.args,
                       [Sum(t, contributions) for t in sums], self.streams)
        return sums

    def write(self, targets, zero_rest: bool = True) -> None:
        """Write the calls' dK/dV into ``targets`` (zero outside their keys if ``zero_rest``)."""
        if not self.calls:
            for t in targets:
                t.zero_()
            return
        keys = self.calls[0].keys
        if zero_rest:
            for t in targets:
                zero_outside(t, keys)
        if targets[0].dtype == self.args[2].dtype:
            self._grads(0, targets)
        else:
            for t, grad in zip(targets, self._grads(0)):  # fp32 sums of bf16 gradients
                put_rows(t, keys, grad)
        self._add_rest(targets)

    def _add_rest(self, sums) -> None:
        """Add the dK/dV of every call but the first into ``sums``."""
        for i in range(1, len(self.calls)):
            for acc, grad in zip(sums, self._grads(i)):
                add_rows(acc, self.calls[i].keys, grad)

    def _grads(self, i: int, targets=(None, None)):
        return call_grads(self.calls[i], self.kernel, self.dq_sum, self.args,
                          self.streams and self.streams(i), targets)


class Arriving:
    """A transfer in flight: ``wait()`` calls ``finish``, or returns what already arrived."""

    def __init__(self, finish):
        self.wait = finish if callable(finish) else lambda: finish


def blocks(spec, *tensors):
    """Packed [T, H, E] tensors as [1, H, T, E] blocks (dense ones as they are)."""
    return [as_block(t) for t in tensors] if spec.layout.is_varlen else tensors
