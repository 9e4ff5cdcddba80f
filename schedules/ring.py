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
travel the ring with the block and end on the owner, P - 1 hops in all (fewer shifts under a
window, see below). The owner works on its own block last, while its sums make their last
hop, writes its own dK/dV straight into its gradients and adds the sums. Only the first
block of a backward keeps the GPU waiting (nothing precedes it): a call of one group (auto)
on large blocks runs its backward as two groups (dense, no dropout: ``_backward_groups``),
and the first works on its own block first, while the first block travels, and adds its
sums once the second has worked on its first block. Every step uses the global
out and lse of the forward. When a block's sums come from one rank alone (P = 2, dense, no
window), that rank writes only its call's keys and the owner adds only those rows.

Head groups (``head_groups``, see ``schedules.heads``): the ring runs over G groups of K/V
heads one after another, each group's blocks 1/G of the whole; the first block of the next
group travels during the last step of the current one, so only the very first transfer of a
call waits. What each rank holds at the peak (G groups, P ranks, blocks of one group):

    forward   out, lse; two K/V slots (one when only one block travels); the block's output;
              an fp32 accumulator of the group's out only when a row gets more than two
              blocks (P > 2: with two, the first is written into out as is and the second
              merged into it, rounding once)
    backward  saved out, lse; dq, dk, dv; two K/V slots; the received dK/dV sums (one slot
              at P = 2, two above) and the sums sent on; a dQ temporary and the kernel's
              workspace; an fp32 dQ sum only when more than two blocks add to it

dK/dV sums travel in ``grad_dtype``: "auto" takes the input dtype at P = 2 without a window,
where the sums that travel are one kernel result each (nothing is rounded that fp32 sums
would not round), and fp32 otherwise; "input" always travels in the input dtype (half the
bytes of fp32, one more rounding per hop), "fp32" always in fp32.

The blocks and sums travel through ``transport`` (NCCL/gloo send-receive, or copy engines
writing into the next rank's symmetric slots on GPUs): the own K/V goes out without a copy.

Packed sequences: each step is one varlen kernel call over every sequence, the step's case
applied to each sequence's part and cut to its real tokens (``packed_call``; the rows are
made once per packing). The blocks are the whole local K/V, padding included, so every
block has one size.

Sliding windows: each step's calls come from ``bands`` (every call a window in its own rows
and keys; none for a block the window does not reach), and the ring takes only the steps at
which some rank's queries see a key of the block. A shift then sends the block, and in
backward its dK/dV sums, straight to the rank of its next step: several hops at once. Only
the rows of a block that other ranks' queries see travel (``bands.ring_plan``: the
widest such hull over the blocks, so that every shift has one shape): a 4K window over 64K
tokens per rank moves 1/16 of each block, and its sums only those rows. With
head groups every group takes those steps, and the next group's own block goes straight to
the rank of its first step. A row may then get more blocks than steps (a block split into
calls), so out and dQ of 16-bit inputs are summed in fp32 whenever a rank makes more than
two calls.

Composed masks (``mask=``): each step is the block's ``MaskedCall`` (``schedules.mask_plans``:
band calls merged inside it; none for a block no query of the rank sees), and the ring takes
only the steps at which some rank's queries see a key of the block: whole blocks travel, a
skipped step moves nothing.

Dropout: every kernel call draws its own stream, keyed by this rank, the block's owner, the
head group and the call's place in its step, the same in forward and backward.
"""

from __future__ import annotations

import enum

import torch

from sdpa_fusion.kernels.base import layout_of
from sdpa_fusion.merge import Merged

from . import dry_run, heads, mask_plans
from .bands import check_runs, ring_plan, window_band
from .base import Description
from .calls import (DenseCall, PackedCall, Sum, add_rows, as_block, as_packed, call_grads,
                    dq_sum_of, fold_calls, gradients, outputs, part_call, put_rows, zero_outside)
from .overlap import Overlap
from .partition import Contiguous, LoadBalanced, Striped
from .sequence import SequenceSchedule
from .transport import RingData, Transported
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
    """(query span, key span, causal) that a block case computes, for blocks of ``s_q``
    queries and ``s_kv`` keys (ints, or per-sequence tensors for packed blocks)."""
    return {
        Block.FULL: ((0, s_q), (0, s_kv), False),
        Block.CAUSAL: ((0, s_q), (0, s_kv), True),
        Block.EARLY_KEYS: ((0, s_q), (0, s_kv // 2), False),
        Block.LATE_QUERIES: ((s_q // 2, s_q), (0, s_kv), False),
        Block.SHIFTED: ((1, s_q), (0, s_kv - 1), True),
    }[case]


def _span(span, n: int) -> slice:
    return slice(None) if span == (0, n) else slice(*span)


def dense_call(case: Block, s_q: int, s_kv: int) -> DenseCall | None:
    """The kernel call of a block case on dense blocks (None for SKIP)."""
    if case is Block.SKIP:
        return None
    rows, keys, causal = _ranges(case, s_q, s_kv)
    return DenseCall(_span(rows, s_q), _span(keys, s_kv), causal)


def packed_call(case: Block, packing, source: int) -> PackedCall | None:
    """The varlen call of a block case on the parts of every packed sequence: the dense case
    applied to each sequence's part, cut to its real tokens (None when nothing is left)."""
    if case is Block.SKIP:
        return None
    storage = packing.split.storage
    rows, keys, causal = _ranges(case, storage, storage)
    return part_call(packing, source, rows, keys, causal)


def check_grad_dtype(grad_dtype: str) -> str:
    """``grad_dtype`` if it is one of GRAD_DTYPES, else a ValueError naming them."""
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype={grad_dtype!r} is not known; choose one of {GRAD_DTYPES} "
                         f"(the dtype the dK/dV sums travel in)")
    return grad_dtype

@whole_documents
class Ring(Transported, SequenceSchedule):
    """Pass-KV ring attention; ``transport`` picks how blocks travel (see ``transport``),
    ``head_groups`` how many K/V head groups run in turn (see ``schedules.heads``),
    ``grad_dtype`` the dtype dK/dV sums travel in."""

    name = "ring"
    overlap = Overlap(hidden=lambda p: (p - 1) / p, splits_keys=True, own_transport=True)

    def __init__(self, mesh, *, dim=None, partition="auto", transport="auto",
                 head_groups="auto", grad_dtype="auto"):
        super().__init__(mesh, dim=dim, partition=partition, head_groups=head_groups)
        self.use_transport(transport)
        self.grad_dtype = check_grad_dtype(grad_dtype)

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
        """A ring step's calls stay inside this rank's block: its rows against a block of as
        many keys (packed: each sequence's share)."""
        if spec.packing is not None:
            return spec.packing.longest_share, spec.packing.longest_share
        return spec.q_len, spec.kv_len

    def kernel_calls(self, spec) -> int:
        """The kernel calls this rank makes on the local ``spec``: one per ring step whose
        block its queries see (all P load-balanced; fewer under a contiguous causal split, a
        window or a mask), a band perhaps split in two."""
        steps, _ = self._plan(spec, spec.q_len, spec.kv_len)
        return max(1, sum(len(calls) for _, calls in steps))

    def sums_dtype(self, spec) -> torch.dtype:
        """The dtype dK/dV sums of a call on ``spec`` (global or local) travel in."""
        if self.grad_dtype == "input" or (self.grad_dtype == "auto" and self.size == 2
                                          and window_band(spec) is None):
            return spec.dtype
        return torch.float32

    def _plan(self, spec, s_q: int, s_kv: int):
        """(steps, travel): (step, kernel calls) of every ring step this rank takes, in order,
        at step i the block of rank (r - i) mod P; every step without a window, with one only
        the steps at which some rank's queries see a key, and ``travel`` the rows of each
        block that travel (``bands.ring_plan``; None: whole blocks). Packed calls are made
        once per packing."""
        if spec.mask is not None:  # a composed mask: its steps and calls, whole blocks
            return mask_plans.ring_plan(spec, self.partition, self.size, self.index), None
        mask = window_band(spec)
        if mask is not None:
            return ring_plan(spec, mask, self.partition, self.size, self.index)
        calls = self._calls(spec, s_q, s_kv)
        return [(step, [] if call is None else [call]) for step, call in enumerate(calls)], None

    def _sent(self, t: torch.Tensor, travel) -> torch.Tensor:
        """The rows of this rank's block ``t`` that travel."""
        if travel is None:
            return t
        n, starts = travel
        return t.narrow(2, starts[self.index], n)

    def _calls(self, spec, s_q: int, s_kv: int) -> list:
        """The kernel call (or None) of every ring step of this rank without a window."""
        sources = [(self.index - step) % self.size for step in range(self.size)]

        def case(source):
            return block_case(self.index, source, spec.causal, self.partition)

        packing = spec.packing
        if packing is None:
            return [dense_call(case(j), s_q, s_kv) for j in sources]
        return packing.cached(("ring", spec.causal),
                              lambda: [packed_call(case(j), packing, j) for j in sources])

    def group_rows(self, rows: int, spec) -> int:
        """Under a sliding window of span w (keys a query may see) a block's calls are bands
        of about w keys per row and only about w of its rows travel: its head groups are
        sized as a block of min(rows, w) rows (one group at 4K keys where a dense 64K block
        takes four, whose 4x the calls and barriers cost more than they save)."""
        mask = window_band(spec)
        if mask is None or None in mask:
            return rows
        return min(rows, mask[0] + mask[1] + 1)

    def _step_count(self, spec) -> int:
        """Steps every rank takes for the global ``spec`` (the own block's included)."""
        if window_band(spec) is None and spec.mask is None:
            return self.size
        local = self.local_spec(spec)
        return len(self._plan(local, local.q_len, local.kv_len)[0])

    def _streams(self, dropout, step: int, group: heads.HeadGroup):
        """The dropout streams of this rank's queries of head group ``group`` against the
        block of ring step ``step``, one per kernel call of the step (``streams(i)``); None
        without dropout."""
        if dropout is None:
            return None
        source = (self.index - step) % self.size
        return lambda call: dropout.stream("ring", self.index, source, group.index, call)

    def _kv_steps(self, k, v, groups, orders, remote, kv, travel=None):
        """(group, step, K block, V block) for every group g and every step of ``orders[g]``:
        the block of rank r - step (step 0: this rank's own), K/V coming through the ring
        ``kv`` (None when no block travels). ``remote``: the steps other than 0, in order; a
        block goes from the rank of one to that of the next, several hops at once (its rows
        ``travel``, all by default). One shift is in flight at a time: a block travels on (or
        the next group's own block leaves) while the current one is used."""
        own = [(g.of_kv(k), g.of_kv(v)) for g in groups]
        leaving = [tuple(self._sent(t, travel) for t in block) for block in own]
        following = dict(zip(remote, remote[1:]))
        if kv is not None:
            pending = kv.shift(leaving[0], hops=remote[0])
        for index, g in enumerate(groups):
            for step in orders[index]:
                if step == 0:
                    yield g, 0, *own[index]
                    continue
                block = tuple(pending.wait())
                if step in following:
                    pending = kv.shift(block, hops=following[step] - step)
                elif index + 1 < len(groups):
                    pending = kv.shift(leaving[index + 1], hops=remote[0])
                yield g, step, *block

    def _rings(self, k, groups, remote, travel, *dtypes_and_slots):
        """One ring per (dtype, slots) carrying a group's two [B, H_kv/G, S, E] tensors (S:
        the rows that ``travel``), all in this call's buffer of the transport; Nones when no
        block travels."""
        if not remote:
            return [None] * len(dtypes_and_slots)
        shape = tuple(self._sent(groups[0].of_kv(k), travel).shape)
        datas = [RingData((shape, shape), dtype, layout_of(k), slots)
                 for dtype, slots in dtypes_and_slots]
        return self.mover(k.device).rings(datas, k.device)

    @staticmethod
    def _kv_slots(groups: int, remote: int) -> int:
        """Receive slots of the K/V ring for ``remote`` steps per group: two, or one when
        only one block travels."""
        return min(2, groups * remote)

    @staticmethod
    def _sums_slots(remote: int) -> int:
        """Receive slots of the dK/dV sums ring: with one remote step per group (P = 2, or a
        window that needs one) the sums a rank receives are used up (added to its own)
        before it sends the next group's, so one; else two."""
        return 1 if remote == 1 else 2

    def forward(self, q, k, v, spec, kernel, dropout=None, *, out=None, lse=None):
        packed = spec.layout.is_varlen
        if packed:
            q, k, v = (as_block(t) for t in (q, k, v))
        steps, travel = self._plan(spec, q.shape[2], k.shape[2])
        calls, order = dict(steps), [step for step, _ in steps]
        remote = order[1:]
        groups = self.groups_of(q, k, spec)
        out, lse = outputs(q, out, lse, packed)
        blocks = sum(len(c) for c in calls.values())
        (kv,) = self._rings(k, groups, remote, travel,
                            (k.dtype, self._kv_slots(len(groups), len(remote))))
        for g, step, kb, vb in self._kv_steps(k, v, groups, [order] * len(groups), remote, kv,
                                              travel):
            if step == 0:
                merged = Merged(g.of_q(out), g.of_q(lse), blocks)
            fold_calls(calls[step], kernel, merged, g.of_q(q), kb, vb, spec.softmax_scale,
                       self._streams(dropout, step, g))
            if step == order[-1]:
                merged.finish()
        return (as_packed(out) if packed else out), lse

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None, *, dq=None, dk=None,
                 dv=None):
        packed = spec.layout.is_varlen
        if packed:
            dout, q, k, v, out = (as_block(t) for t in (dout, q, k, v, out))
        steps, travel = self._plan(spec, q.shape[2], k.shape[2])
        calls, remote = dict(steps), [step for step, _ in steps[1:]]
        home = dict(zip(remote, [*remote[1:], self.size]))  # where a block's sums go next
        groups = self.groups_of(q, k, spec)
        count = self._backward_groups(len(groups), spec, len(remote), k.shape[1], q.shape[1],
                                      q.shape[2])
        split = count != len(groups)
        groups = heads.groups_of(count, q.shape[1], k.shape[1]) if split else groups
        orders = self._backward_orders(len(groups), remote, own_first=split)
        dq, dk, dv = gradients((q, k, v), (dq, dk, dv), packed)
        one_hop = self._sums_make_one_hop(spec, remote)
        carried = self._sums_rows(spec, remote, q.shape[2], k.shape[2]) if one_hop else None
        kv, sums = self._rings(k, groups, remote, travel,
                               (k.dtype, self._kv_slots(len(groups), len(remote))),
                               (self.sums_dtype(spec), self._sums_slots(len(remote))))
        early = None  # (gradients, sums on their way) of an own block worked on first
        for g, step, kb, vb in self._kv_steps(k, v, groups, orders, remote, kv, travel):
            order = orders[g.index]
            args = (g.of_q(dout), g.of_q(q), kb, vb, g.of_q(out), g.of_q(lse), spec.softmax_scale)
            if step == order[0]:
                dq_sum = dq_sum_of(kernel, g.of_q(dq), [c for s in order for c in calls[s]],
                                   args, dropout)
            run = _Step(calls[step], kernel, dq_sum, args, self._streams(dropout, step, g))
            if step == 0:  # the own block: its dK/dV straight into the gradients, plus the sums
                targets = (g.of_kv(dk), g.of_kv(dv))
                run.write(targets)
                if sums is not None and step == order[-1]:  # they arrived meanwhile
                    self._add_sums(targets, sent, travel, carried)
            elif step == remote[0]:  # this rank starts the block's sums
                outgoing = sums.data.empty(k.device)
                run.write(outgoing, zero_rest=not one_hop)
                if early is not None:  # before this shift's slot takes the next sums
                    self._add_sums(*early, travel, carried)
                    early = None
                sent = sums.shift(outgoing, hops=home[step] - step)
                del outgoing  # the transport holds it until it has left
            else:  # add to the sums of the ranks before, which arrive meanwhile
                sent = sums.shift(run.add_into(sent), hops=home[step] - step)
            if step == order[-1]:
                dq_sum.finish()
                if order[0] == 0 and sums is not None:  # its sums come home with this shift
                    early = (targets, sent)
        if packed:
            dq, dk, dv = (as_packed(t) for t in (dq, dk, dv))
        return dq, dk, dv

    def _add_sums(self, targets, pending, travel, rows=None) -> None:
        """Add the dK/dV sums ``pending`` brings into this rank's ``targets`` (their ``rows``
        only, when given: see ``_sums_rows``)."""
        for target, summed in zip(targets, pending.wait()):
            target = self._sent(target, travel)
            if rows is None:
                target.add_(summed)
            else:
                add_rows(target, rows, summed[:, :, rows])

    @staticmethod
    def _sums_make_one_hop(spec, remote: list[int]) -> bool:
        """Whether the dK/dV sums of a block come from one rank alone, straight home, in one
        dense call without a window (one remote step: P = 2): that rank then writes only
        its call's keys (``_Step.write``, nothing zeroed) and the owner adds only those
        (``_sums_rows``), half of a block at P = 2 with the load-balanced partition.
        Otherwise every row travels, zeros where no call reached."""
        return len(remote) == 1 and not spec.layout.is_varlen and window_band(spec) is None

    def _sums_rows(self, spec, remote: list[int], s_q: int, s_kv: int) -> slice | None:
        """The rows of this rank's block that its one-hop sums carry: the keys of the call
        the rank before makes on it; None (all rows, zeros) when that rank makes none."""
        sender = (self.index + remote[0]) % self.size
        call = dense_call(block_case(sender, self.index, spec.causal, self.partition), s_q, s_kv)
        return None if call is None else call.keys

    def _backward_groups(self, groups: int, spec, remote: int, kv_heads: int, heads_q: int,
                         rows: int) -> int:
        """Head groups of a backward whose forward ran ``groups`` over ``kv_heads`` K/V heads
        and ``heads_q`` query heads of ``rows`` rows, with ``remote`` steps that receive a
        block: the forward's, or two where the forward runs one, blocks travel,
        ``head_groups`` is "auto", the blocks are large (query heads x ``group_rows`` at least
        ``heads.MIN_GROUP_WORK``: below, the host's work for twice the calls costs more than
        the wait saves), the sequences are dense (a packed step is one varlen call over every
        sequence) and no dropout keys the groups. The first group then works on its own
        block while the first block arrives."""
        work = heads_q * self.group_rows(rows, spec)
        if (groups == 1 and remote and self.head_groups == "auto" and not spec.layout.is_varlen
                and spec.dropout_p == 0 and kv_heads % 2 == 0 and work >= heads.MIN_GROUP_WORK):
            return 2
        return groups

    @staticmethod
    def _backward_orders(groups: int, remote: list[int], *, own_first: bool) -> list[list[int]]:
        """The backward's steps of each head group: the remote blocks, then the own block
        (while the last sums make their last hop). With ``own_first`` (a group split in two)
        the first group takes its own block first instead (while the first block travels),
        and its sums are added once the next group has worked on its first block. (Forward
        groups of 1/G of the block wait 1/G of a transfer; their first own block first would
        hold a group's sums longer, more memory than that wait is worth.)"""
        last = [*remote, 0]
        return [[0, *remote] if g == 0 and own_first and remote else last
                for g in range(groups)]

    # ---- costs -----------------------------------------------------------------------------
    def describe(self, spec):
        p, steps = self.size, self._step_count(spec)
        kv_block = 2 * spec.batch * spec.kv_heads * self._block_rows(spec) * spec.head_dim
        kv_bytes = kv_block * spec.dtype.itemsize
        sums_bytes = kv_block * self.sums_dtype(spec).itemsize
        forward = spec.flops() / p
        groups, shifts = self.groups_for(spec), steps - 1
        back = self._backward_groups(groups, spec, shifts, spec.kv_heads, spec.heads,
                                     self.local_tokens(spec))
        return Description(
            self.name, p, steps=steps * groups, bytes_sent=shifts * kv_bytes,
            bytes_received=shifts * kv_bytes, flops=forward, backward_steps=steps * back,
            backward_bytes_sent=shifts * (kv_bytes + sums_bytes),
            backward_bytes_received=shifts * (kv_bytes + sums_bytes),
            backward_flops=spec.flops(backward=True) / p - forward,
            notes=f"partition {self.partition.name}; transport {self.transport}; "
                  f"{groups} head group(s) ({back} in backward); K/V blocks of "
                  f"{kv_bytes // groups} bytes, dK/dV sums of {sums_bytes // back} bytes "
                  f"({self.sums_dtype(spec)})",
            memory_of=dry_run.memory_of(self, spec),
        )

    def _block_rows(self, spec) -> int:
        """Rows of the blocks that travel in a call on the global ``spec``."""
        rows = self.local_tokens(spec)
        _, travel = self._plan(self.local_spec(spec), rows, rows)
        return rows if travel is None else travel[0]

class _Step:
    """One backward step: the kernel calls (maybe none) of a head group's tensors on one K/V
    block, ``args`` = (dout, q, K block, V block, out, lse, scale); their dQ goes into
    ``dq_sum``, call i draws dropout stream ``streams(i)``."""

    def __init__(self, calls, kernel, dq_sum: Sum, args, streams):
        self.calls, self.kernel, self.dq_sum = calls, kernel, dq_sum
        self.args, self.streams = args, streams

    def add_into(self, pending):
        """Add the calls' dK/dV to the sums ``pending`` brings (they arrive while the first
        call runs); returns the sums."""
        grads = self._grads(0) if self.calls else ()
        summed = pending.wait()
        for acc, grad in zip(summed, grads):
            add_rows(acc, self.calls[0].keys, grad)
        del grads
        self._add_rest(summed)
        return summed

    def write(self, targets, zero_rest: bool = True) -> None:
        """Write the calls' dK/dV into ``targets`` (full blocks: zero outside the calls'
        keys, unless not ``zero_rest``: then only the first call's keys are written, and
        nobody reads the rest); the first call's straight from the kernel when they have the
        kernel's dtype."""
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
