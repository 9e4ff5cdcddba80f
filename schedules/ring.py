"""``ring``: context parallelism by passing K/V blocks around the ring of ranks (pass-KV).

At step i rank r holds the K/V block of rank (r - i) mod P. While it attends its queries to
that block, the block travels on to rank r + 1 and the next one arrives from rank r - 1
(async, two receive slots). Each step's (out, lse) is folded into the result in place
(``Merged``).

Causal masks per step come from ``block_case`` (no communication). With the load-balanced
partition every rank holds an early chunk and a late chunk of the sequence, and every step
after the first costs half a block:

    own block            causal over the local tokens
    block of a rank < r  all local queries vs the block's first (early) chunk
    block of a rank > r  the local late chunk vs the whole block

Backward: dQ sums locally; the dK/dV sums of a block start on the rank after its owner,
travel the ring with the block and end on the owner, which works on its own block last, while
its sums make their last hop. A one-group call on large blocks runs its backward as two
groups (``_backward_groups``), the first working on its own block while the first block
travels, so that only the very first transfer keeps the GPU waiting. Head groups
(``schedules.heads``) run in turn, the next group's first block travelling during the
current group's last step.

dK/dV sums travel in ``grad_dtype``: "auto" takes the input dtype at P = 2 without a window
(each sum that travels is one kernel result: nothing is rounded that fp32 would not round),
fp32 otherwise. Out and dQ are summed in fp32 only when a row gets more than two blocks.

Packed sequences: each step is one varlen call, the case applied to every sequence's part.

Sliding windows and composed masks (``mask=``): each step's calls come from ``bands`` (or
one ``MaskedCall``, ``schedules.mask_plans``), and the ring takes only the steps at which
some rank's queries see a key of the block; a shift sends a block (and its sums) straight to
the rank of its next step. Under a window only the rows of a block that other ranks' queries
see travel (``bands.ring_plan``): a 4K window over 64K tokens per rank moves 1/16 of a block.

Dropout: every call draws its own stream, keyed by this rank, the block's owner, the head
group and the call's place. All of it is a plan (``Ring.plan``: ops of ``schedules.runner``).
"""

from __future__ import annotations

import enum

import torch

from . import dry_run, heads, mask_plans, runner
from .assign import RING
from .bands import check_runs, ring_plan, window_band
from .base import Description
from .calls import DenseCall, PackedCall, most_calls_per_row, part_calls
from .overlap import Overlap
from .partition import Contiguous, LoadBalanced, Striped
from .sequence import SequenceSchedule
from .transport import Transported
from .whole import whole_documents

GRAD_DTYPES = ("auto", "fp32", "input")


class Block(enum.Enum):
    """Which queries of this rank meet which keys of a ring block, and with what mask."""

    FULL = "all queries vs all keys"
    CAUSAL = "all vs all, causal"
    EARLY_KEYS = "all queries vs the first half of the keys"
    LATE_QUERIES = "second half of the queries vs all keys"
    SHIFTED = "queries 1.. vs keys ..-1, causal"
    SKIP = "nothing"


def block_case(rank: int, source: int, causal: bool, partition) -> Block:
    """The mask case of the block that ``source`` owns, seen from ``rank`` (pure)."""
    if not causal:
        return Block.FULL
    if source == rank:
        return Block.CAUSAL
    earlier = source < rank
    if isinstance(partition, LoadBalanced):
        return Block.EARLY_KEYS if earlier else Block.LATE_QUERIES
    if isinstance(partition, Contiguous):
        return Block.FULL if earlier else Block.SKIP
    if isinstance(partition, Striped):
        return Block.CAUSAL if earlier else Block.SHIFTED
    raise ValueError(f"ring has no causal mask for partition {partition.name!r}")


def _ranges(case: Block, s_q, s_kv):
    """(query span, key span, causal) of a block case on ``s_q`` queries, ``s_kv`` keys."""
    return {
        Block.FULL: ((0, s_q), (0, s_kv), False),
        Block.CAUSAL: ((0, s_q), (0, s_kv), True),
        Block.EARLY_KEYS: ((0, s_q), (0, s_kv // 2), False),
        Block.LATE_QUERIES: ((s_q // 2, s_q), (0, s_kv), False),
        Block.SHIFTED: ((1, s_q), (0, s_kv - 1), True),
    }[case]


def dense_call(case: Block, s_q: int, s_kv: int) -> DenseCall | None:
    """The kernel call of a block case on dense blocks (None for SKIP)."""
    if case is Block.SKIP:
        return None
    rows, keys, causal = _ranges(case, s_q, s_kv)
    rows, keys = (slice(None) if span == (0, n) else slice(*span)
                  for span, n in ((rows, s_q), (keys, s_kv)))
    return DenseCall(rows, keys, causal)


def packed_calls(case: Block, packing, source: int) -> list[PackedCall]:
    """The varlen calls of a block case on the parts of every packed sequence (one, or one
    per sequence where few sequences' rows are scattered: ``calls.part_calls``)."""
    if case is Block.SKIP:
        return []
    storage = packing.split.storage
    rows, keys, causal = _ranges(case, storage, storage)
    return part_calls(packing, source, rows, keys, causal)



@whole_documents
class Ring(Transported, SequenceSchedule):
    """Pass-KV ring attention; blocks travel by ``transport``, dK/dV sums in ``grad_dtype``."""

    name = "ring"
    overlap = Overlap(hidden=lambda p: (p - 1) / p, splits_keys=True, own_transport=True)
    exchange = RING  # a rank's rings cost per step and per token of the documents they cut

    def __init__(self, mesh, *, dim=None, partition="auto", transport="auto",
                 head_groups="auto", grad_dtype="auto"):
        super().__init__(mesh, dim=dim, partition=partition, head_groups=head_groups)
        self.use_transport(transport)
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype={grad_dtype!r} is not known; choose one of {GRAD_DTYPES} "
                             f"(the dtype the dK/dV sums travel in)")
        self.grad_dtype = grad_dtype

    def validate(self, spec):
        super().validate(spec)
        if window_band(spec) is not None:  # causal is part of the window's band
            check_runs(spec, self.partition, self.size, self.name)
        elif spec.causal and not isinstance(self.partition, (Contiguous, LoadBalanced, Striped)):
            raise ValueError(
                f"ring attention with causal=True takes partition 'load_balanced', 'contiguous' "
                f"or 'striped', not {self.partition.name!r}; use causal=False, one of those, or "
                f"schedule 'ulysses' (causal with any partition)"
            )

    def call_extent(self, spec) -> tuple[int, int]:
        """A ring step's calls stay inside this rank's block (packed: a sequence's share)."""
        if spec.packing is not None:
            return spec.packing.longest_share, spec.packing.longest_share
        return spec.q_len, spec.kv_len

    def kernel_calls(self, spec) -> int:
        """The kernel calls this rank makes on the local ``spec``."""
        steps, _ = self._plan(spec, spec.q_len, spec.kv_len)
        return max(1, sum(len(calls) for _, calls in steps))

    def sums_dtype(self, spec) -> torch.dtype:
        """The dtype dK/dV sums of a call on ``spec`` (global or local) travel in."""
        if self.grad_dtype == "input" or (self.grad_dtype == "auto" and self.size == 2
                                          and window_band(spec) is None):
            return spec.dtype
        return torch.float32

    def _plan(self, spec, s_q: int, s_kv: int):
        """((step, kernel calls) of the ring steps this rank takes, the rows that travel)."""
        if spec.mask is not None:  # a composed mask: its steps and calls, whole blocks
            return mask_plans.ring_plan(spec, self.partition, self.size, self.index), None
        mask = window_band(spec)
        if mask is not None:
            return ring_plan(spec, mask, self.partition, self.size, self.index)
        return list(enumerate(self._calls(spec, s_q, s_kv))), None

    def _calls(self, spec, s_q: int, s_kv: int) -> list[list]:
        """The kernel calls of every ring step of this rank without a window."""
        me = self.index
        sources = [(me - step) % self.size for step in range(self.size)]

        def case(source):
            return block_case(me, source, spec.causal, self.partition)

        packing = spec.packing
        if packing is None:
            return [[c] if (c := dense_call(case(j), s_q, s_kv)) else [] for j in sources]
        return packing.cached(("ring", spec.causal),
                              lambda: [packed_calls(case(j), packing, j) for j in sources])

    def group_rows(self, rows: int, spec) -> int:
        """Under a window of span w a block's calls are bands of about w keys and about w rows
        travel: groups are sized for min(rows, w) rows (one at 4K keys where a dense 64K block
        takes four, whose calls and barriers cost more than they save)."""
        mask = window_band(spec)
        if mask is None or None in mask:
            return rows
        return min(rows, mask[0] + mask[1] + 1)

    def rings_mover(self, device):
        return self.mover(device)

    # ---- the plan ------------------------------------------------------------------------
    def plan(self, spec, q, k, *, backward: bool) -> runner.Plan:
        """This rank's ``runner.Plan`` of a forward (or ``backward``) on the local ``spec``."""
        steps, travel = self._plan(spec, q.shape[2], k.shape[2])
        calls, remote = dict(steps), [step for step, _ in steps[1:]]
        groups = len(self.groups_of(q, k, spec))
        if travel is not None:
            travel = (travel[1][self.index], travel[0])
        if not backward:  # K/V slots: two, or one when only one block travels
            blocks = most_calls_per_row([c for step in calls.values() for c in step],
                                        q.shape[2])
            return runner.Plan(self._forward_ops(calls, remote, groups, blocks), groups,
                               travel, min(2, groups * len(remote)))
        count = self._backward_groups(groups, spec, len(remote), k.shape[1], q.shape[1],
                                      q.shape[2])
        # a block's dK/dV sums come from one rank alone, straight home, in one dense call
        # without a window (P = 2): that rank writes only its call's keys, the owner adds
        # only those (``_sums_rows``): half a block at P = 2, load-balanced
        one_hop = len(remote) == 1 and not spec.layout.is_varlen and window_band(spec) is None
        # with one remote step per group the sums a rank receives are added to its own before
        # it sends the next group's: one slot
        sums_slots = 1 if len(remote) == 1 else 2
        return runner.Plan(
            self._backward_ops(calls, remote, count, own_first=count != groups,
                               one_hop=one_hop),
            count, travel, min(2, count * len(remote)),
            (self.sums_dtype(spec), sums_slots) if remote else None,
            self._sums_rows(spec, remote, q.shape[2], k.shape[2]) if one_hop else None)

    def _steps(self, groups: int, orders, remote):
        """(group, step, K/V ops) of every step of ``orders[g]``; one shift in flight at a time."""
        following = dict(zip(remote, remote[1:]))
        first = [runner.Send(remote[0], group=0)] if remote else []
        for g in range(groups):
            for step in orders[g]:
                ops = [runner.KV(g, arrives=step != 0)]
                if step in following:
                    ops.append(runner.Send(following[step] - step))
                elif step != 0 and g + 1 < groups:
                    ops.append(runner.Send(remote[0], group=g + 1))
                yield g, step, first + ops
                first = []

    def _stream(self, step: int, group: int) -> tuple:
        """The dropout stream key of this rank's calls on the block of ring step ``step``."""
        return "ring", self.index, (self.index - step) % self.size, group

    def _forward_ops(self, calls, remote, groups: int, blocks: int) -> tuple:
        """Forward: each group's rows merge the calls of every step, ``blocks`` at most."""
        order = [0, *remote]
        ops = []
        for g, step, kv in self._steps(groups, [order] * groups, remote):
            ops += kv
            if step == 0:
                ops.append(runner.Open(g, blocks))
            ops.append(runner.Fold(tuple(calls[step]), self._stream(step, g)))
            if step == order[-1]:
                ops.append(runner.Finish())
        return tuple(ops)

    def _backward_ops(self, calls, remote, groups: int, *, own_first: bool,
                      one_hop: bool) -> tuple:
        """Backward: a block's sums start on the rank after its owner (NEW), gather every
        rank's share (ARRIVING) and end on the owner (AddSums); an own block worked on first
        has its sums added once the next group's first block is worked on (``early``)."""
        home = dict(zip(remote, [*remote[1:], self.size]))  # where a block's sums go next
        orders = self._backward_orders(groups, remote, own_first=own_first)
        ops, early = [], None
        for g, step, kv in self._steps(groups, orders, remote):
            order, own = orders[g], tuple(calls[step])
            ops += kv
            if step == order[0]:
                ops.append(runner.OpenDq(g, tuple(c for s in order for c in calls[s])))
            stream = self._stream(step, g)
            if step == 0:
                ops.append(runner.Grads(own, stream, runner.OWN))
                if remote and step == order[-1]:  # its sums arrived meanwhile
                    ops.append(runner.AddSums(g))
            elif step == remote[0]:  # this rank starts the block's sums
                ops.append(runner.Grads(own, stream, runner.NEW, zero_rest=not one_hop))
                if early is not None:  # before this shift's slot takes the next sums
                    ops.append(runner.AddSums(early))
                    early = None
                ops.append(runner.SendSums(home[step] - step))
            else:  # add to the sums of the ranks before, which arrive meanwhile
                ops += [runner.Grads(own, stream, runner.ARRIVING),
                        runner.SendSums(home[step] - step)]
            if step == order[-1]:
                ops.append(runner.FinishDq())
                if order[0] == 0 and remote:  # its sums come home with this shift
                    early = g
        return tuple(ops)

    def _sums_rows(self, spec, remote: list[int], s_q: int, s_kv: int) -> slice | None:
        """The rows of this rank's block that its one-hop sums carry: the keys of the call
        the rank before makes on it; None (all rows, zeros) when that rank makes none."""
        sender = (self.index + remote[0]) % self.size
        call = dense_call(block_case(sender, self.index, spec.causal, self.partition), s_q, s_kv)
        return None if call is None else call.keys

    def _backward_groups(self, groups: int, spec, remote: int, kv_heads: int, heads_q: int,
                         rows: int) -> int:
        """Head groups of a backward whose forward ran ``groups``: two for one on large dense
        blocks that travel (below ``heads.MIN_GROUP_WORK`` the host's work for twice the calls
        costs more than the wait saves), "auto" groups and no dropout; else the forward's."""
        work = heads_q * self.group_rows(rows, spec)
        if (groups == 1 and remote and self.head_groups == "auto" and not spec.layout.is_varlen
                and spec.dropout_p == 0 and kv_heads % 2 == 0 and work >= heads.MIN_GROUP_WORK):
            return 2
        return groups

    @staticmethod
    def _backward_orders(groups: int, remote: list[int], *, own_first: bool) -> list[list[int]]:
        """The backward's steps of each head group: the remote blocks, then the own block
        (while the last sums make their last hop); with ``own_first`` the first group takes
        its own block first. (Taken first it holds a group's sums longer: more memory than a
        wait of 1/G of a transfer is worth for the other groups.)"""
        last = [*remote, 0]
        return [[0, *remote] if g == 0 and own_first and remote else last
                for g in range(groups)]

    # ---- costs -----------------------------------------------------------------------------
    def describe(self, spec):
        """Steps and bytes counted on this rank's plans for the global ``spec``."""
        forward, backward = runner.plans_of(self, spec)
        block_rows = self.local_tokens(spec) if forward.travel is None else forward.travel[1]

        def block(plan, dtype) -> int:  # bytes of one group's K and V (or sums) that travel
            return plan.kv_bytes(spec, block_rows, dtype)

        sums_dtype = self.sums_dtype(spec)
        kv_bytes = forward.count(runner.Send) * block(forward, spec.dtype)
        back_bytes = backward.count(runner.Send) * block(backward, spec.dtype) + \
            backward.count(runner.SendSums) * block(backward, sums_dtype)
        flops = spec.flops() / self.size
        return Description(
            self.name, self.size, steps=forward.count(runner.Fold), bytes_sent=kv_bytes,
            bytes_received=kv_bytes, flops=flops, backward_steps=backward.count(runner.Grads),
            backward_bytes_sent=back_bytes, backward_bytes_received=back_bytes,
            backward_flops=spec.flops(backward=True) / self.size - flops,
            notes=f"partition {self.partition.name}; transport {self.transport}; "
                  f"{forward.groups} head group(s) ({backward.groups} in backward); K/V blocks "
                  f"of {block(forward, spec.dtype)} bytes, dK/dV sums of "
                  f"{block(backward, sums_dtype)} bytes ({sums_dtype})",
            memory_of=dry_run.memory_of(self, spec),
        )
