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
travel the ring with the block and end on the owner, P - 1 hops in all. The owner works on
its own block last, while its sums make their last hop, writes its own dK/dV straight into
its gradients and adds the sums. Every step uses the global out and lse of the forward.

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

dK/dV sums travel in ``grad_dtype``: "auto" takes the input dtype at P = 2, where the sums
that travel are one kernel result each (nothing is rounded that fp32 sums would not round),
and fp32 above; "input" always travels in the input dtype (half the bytes of fp32, one more
rounding per hop), "fp32" always in fp32.

The blocks and sums travel through ``transport`` (NCCL/gloo send-receive, or copy engines
writing into the next rank's symmetric slots on GPUs): the own K/V goes out without a copy.

Packed sequences: each step is one varlen kernel call over every sequence, the step's case
applied to each sequence's part and cut to its real tokens (``packed_call``; the rows are
made once per packing). The blocks are the whole local K/V, padding included, so every
block has one size.
"""

from __future__ import annotations

import enum

import torch

from sdpa_fusion.kernels.base import layout_of
from sdpa_fusion.merge import Merged

from . import heads
from .base import Description
from .calls import DenseCall, PackedCall, Sum, add_rows, as_block, as_packed, part_call, \
    put_rows, rows_of, zero_outside
from .memory import Memory, Sizes, backward_call, forward_call
from .partition import Contiguous, LoadBalanced, Striped
from .sequence import SequenceSchedule
from .transport import Mover, RingData, aligned, check_transport, mover

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


class Ring(SequenceSchedule):
    """Pass-KV ring attention; ``transport`` picks how blocks travel (see ``transport``),
    ``head_groups`` how many K/V head groups run in turn (see ``schedules.heads``),
    ``grad_dtype`` the dtype dK/dV sums travel in."""

    name = "ring"

    def __init__(self, mesh, *, dim=None, partition="load_balanced", transport="auto",
                 head_groups="auto", grad_dtype="auto"):
        super().__init__(mesh, dim=dim, partition=partition, head_groups=head_groups)
        self.transport = check_transport(transport)
        self.grad_dtype = check_grad_dtype(grad_dtype)
        self._movers: dict[torch.device, Mover] = {}

    def validate(self, spec):
        super().validate(spec)
        if spec.causal and not isinstance(self.partition, (Contiguous, LoadBalanced, Striped)):
            raise ValueError(
                f"ring attention with causal=True takes partition 'load_balanced', 'contiguous' "
                f"or 'striped', not {self.partition.name!r}; use causal=False, one of those, or "
                f"schedule 'ulysses' (causal with any partition)"
            )

    def mover(self, device) -> Mover:
        """The transport's mover of this schedule's blocks on ``device`` (made once)."""
        device = torch.device(device)
        if device not in self._movers:
            self._movers[device] = mover(self.comm, self.transport, device)
        return self._movers[device]

    @property
    def kept_bytes(self) -> int:
        """Bytes of ring buffers kept between calls (the copy-engine transport's symmetric
        memory, which torch.cuda.memory_allocated does not count)."""
        return sum(m.kept_bytes for m in self._movers.values())

    def sums_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype dK/dV sums of ``dtype`` inputs travel in."""
        if self.grad_dtype == "input" or (self.grad_dtype == "auto" and self.size == 2):
            return dtype
        return torch.float32

    def _calls(self, spec, s_q: int, s_kv: int) -> list:
        """The kernel call (or None) of every ring step of this rank, in step order: at step
        i the block of rank (r - i) mod P. Packed calls are made once per packing."""
        sources = [(self.index - step) % self.size for step in range(self.size)]

        def case(source):
            return block_case(self.index, source, spec.causal, self.partition)

        packing = spec.packing
        if packing is None:
            return [dense_call(case(j), s_q, s_kv) for j in sources]
        return packing.cached(("ring", spec.causal),
                              lambda: [packed_call(case(j), packing, j) for j in sources])

    def _kv_steps(self, k, v, groups, order, kv):
        """(group, j, K block, V block) for every group and every j of ``order``: the block
        of rank r - j (j = 0: this rank's own), K/V coming through the ring ``kv`` (None on
        one rank). One shift is in flight at a time: a block travels on (or the next group's
        own block leaves) while the current one is used."""
        own = [(g.of_kv(k), g.of_kv(v)) for g in groups]
        if kv is not None:
            pending = kv.shift(own[0])
        for index, g in enumerate(groups):
            for j in order:
                if j == 0:
                    yield g, 0, *own[index]
                    continue
                block = tuple(pending.wait())
                if j + 1 < self.size:
                    pending = kv.shift(block)
                elif index + 1 < len(groups):
                    pending = kv.shift(own[index + 1])
                yield g, j, *block

    def _rings(self, k, groups, *dtypes_and_slots):
        """One ring per (dtype, slots) carrying a group's two [B, H_kv/G, S, E] tensors, all
        in this call's buffer of the transport; Nones on one rank."""
        if self.size == 1:
            return [None] * len(dtypes_and_slots)
        shape = tuple(groups[0].of_kv(k).shape)
        datas = [RingData((shape, shape), dtype, layout_of(k), slots)
                 for dtype, slots in dtypes_and_slots]
        return self.mover(k.device).rings(datas, k.device)

    def _kv_slots(self, groups: int) -> int:
        """Receive slots of the K/V ring: two, or one when only one block travels."""
        return min(2, groups * (self.size - 1))

    def _sums_slots(self) -> int:
        """Receive slots of the dK/dV sums ring: at P = 2 the sums a rank receives are used
        up (added to its own) before it sends the next group's, so one; else two."""
        return 1 if self.size == 2 else 2

    def forward(self, q, k, v, spec, kernel, dropout=None):
        packed = spec.layout.is_varlen
        if packed:
            q, k, v = (as_block(t) for t in (q, k, v))
        calls = self._calls(spec, q.shape[2], k.shape[2])
        groups = self.groups_of(q, k)
        out = layout_of(q).empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        blocks = sum(c is not None for c in calls)
        (kv,) = self._rings(k, groups, (k.dtype, self._kv_slots(len(groups))))
        for g, j, kb, vb in self._kv_steps(k, v, groups, range(self.size), kv):
            if j == 0:
                merged = Merged(g.of_q(out), g.of_q(lse), blocks)
            call = calls[j]
            if call is not None:
                o, block_lse = call.forward(kernel, g.of_q(q), kb, vb, spec.softmax_scale)
                merged.add(o, block_lse, rows=call.rows)
                del o, block_lse  # free the block's output before the next kernel call
            if j == self.size - 1:
                merged.finish()
        return (as_packed(out) if packed else out), lse

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        packed = spec.layout.is_varlen
        if packed:
            dout, q, k, v, out = (as_block(t) for t in (dout, q, k, v, out))
        calls = self._calls(spec, q.shape[2], k.shape[2])
        groups = self.groups_of(q, k)
        dq, dk, dv = (layout_of(t).empty(t.shape, dtype=t.dtype, device=t.device)
                      for t in (q, k, v))
        contributions = sum(c is not None for c in calls)
        sums_dtype = self.sums_dtype(k.dtype)
        kv, sums = self._rings(k, groups, (k.dtype, self._kv_slots(len(groups))),
                               (sums_dtype, self._sums_slots()))
        order = [*range(1, self.size), 0]  # the own block last
        for g, j, kb, vb in self._kv_steps(k, v, groups, order, kv):
            if j == order[0]:
                dq_sum = Sum(g.of_q(dq), contributions)
            step = _Step(calls[j], kernel, dq_sum, g.of_q(dout), g.of_q(q), kb, vb,
                         g.of_q(out), g.of_q(lse), spec.softmax_scale)
            if j == 0:  # the own block: its dK/dV straight into the gradients, plus the sums
                targets = (g.of_kv(dk), g.of_kv(dv))
                step.write(targets)
                if sums is not None:
                    for target, summed in zip(targets, sent.wait()):
                        target.add_(summed)
                dq_sum.finish()
            elif j == 1:  # this rank starts the block's sums
                outgoing = sums.data.empty(k.device)
                step.write(outgoing)
                sent = sums.shift(outgoing)
                del outgoing  # the transport holds it until it has left
            else:  # add to the sums of the ranks before, which arrive meanwhile
                summed = step.add_into(sent)
                sent = sums.shift(summed)
        if packed:
            dq, dk, dv = (as_packed(t) for t in (dq, dk, dv))
        return dq, dk, dv

    # ---- costs -----------------------------------------------------------------------------
    def describe(self, spec):
        p = self.size
        kv_block = 2 * spec.batch * spec.kv_heads * self.local_tokens(spec) * spec.head_dim
        kv_bytes = kv_block * spec.dtype.itemsize
        sums_bytes = kv_block * self.sums_dtype(spec.dtype).itemsize
        forward = spec.flops() / p
        groups = self.groups_for(spec)
        return Description(
            self.name, p, steps=p * groups, bytes_sent=(p - 1) * kv_bytes,
            bytes_received=(p - 1) * kv_bytes, flops=forward, backward_steps=p * groups,
            backward_bytes_sent=(p - 1) * (kv_bytes + sums_bytes),
            backward_bytes_received=(p - 1) * (kv_bytes + sums_bytes),
            backward_flops=spec.flops(backward=True) / p - forward,
            notes=f"partition {self.partition.name}; transport {self.transport}; "
                  f"{groups} head group(s); K/V blocks of {kv_bytes // groups} bytes, dK/dV "
                  f"sums of {sums_bytes // groups} bytes ({self.sums_dtype(spec.dtype)})",
            memory=self.memory(spec),
        )

    def memory(self, spec) -> Memory:
        """What this rank allocates for a call on the global ``spec`` (the buffers of the
        module docstring, each counted at the step where most of them are alive)."""
        p, rows = self.size, self.local_tokens(spec)
        groups = self.groups_for(spec)
        size, whole = Sizes(spec, rows, groups), Sizes(spec, rows)
        calls = self._calls(self.local_spec(spec), rows, rows)
        done = [c for c in calls if c is not None]
        sums_item = self.sums_dtype(spec.dtype).itemsize
        kv_slots = 0 if p == 1 else self._kv_slots(groups) * aligned(2 * size.kv())
        sums_slots = 0 if p == 1 else self._sums_slots() * aligned(2 * size.kv(itemsize=sums_item))
        kept = kv_slots + sums_slots if self._keeps_slots() else 0
        fresh = not kept  # p2p allocates its slots for each call
        # p2p sends a group's own K/V from a contiguous copy when the group is strided: in
        # flight during the own step, and during the last remote one when a group follows
        copy = 0 if kept or p == 1 or heads.contiguous(spec, groups) else 2 * size.kv()

        def sent(j: int, backward: bool) -> int:
            return copy if (j == 0 and not (backward and groups == 1)) or (
                j == p - 1 and groups > 1) else 0

        fp32_sum = size.q(itemsize=4) if len(done) > 2 and spec.dtype.itemsize < 4 else 0
        acc_item = 4 if fp32_sum else spec.dtype.itemsize
        forward = fresh * kv_slots + fp32_sum + max(
            (forward_call(size, c, rows, acc_item) + sent(j, False)
             for j, c in enumerate(calls) if c is not None), default=0)
        outgoing = 2 * size.kv(itemsize=sums_item)
        steps = []
        for j, c in enumerate(calls):
            if c is None:
                continue
            first = j == (1 if p > 1 else 0)  # the first dQ goes straight into dq
            held = outgoing if j == 1 or j == 2 or (j == 0 and p == 2) else 0
            kv_temps = j >= 2 or (j == 1 and sums_item != spec.dtype.itemsize)
            steps.append(held + sent(j, True) + backward_call(
                size, c, rows, dq_temp=not first or fp32_sum > 0, kv_temps=kv_temps))
        grads = whole.q() + 2 * whole.kv()
        backward = grads + fresh * (kv_slots + sums_slots) + fp32_sum + max(steps, default=0)
        return Memory(outputs=whole.q() + whole.lse(), forward=forward, backward=backward,
                      kept=kept)

    def _keeps_slots(self) -> bool:
        """Whether the slots are kept between calls (the copy-engine transport)."""
        movers = list(self._movers.values())
        if movers:
            return movers[0].name == "copy_engine"
        on_gpus = self.mesh is not None and self.mesh.device.type == "cuda"
        return self.transport == "copy_engine" or (self.transport == "auto" and on_gpus)


class _Step:
    """One backward step: a call (None: nothing) on a head group's tensors and one K/V block;
    its dQ goes into ``dq_sum``."""

    def __init__(self, call, kernel, dq_sum: Sum, dout, q, k, v, out, lse, scale):
        self.call, self.kernel, self.dq_sum = call, kernel, dq_sum
        self.args = (dout, q, k, v, out, lse, scale)

    def add_into(self, pending):
        """Add the call's dK/dV to the sums ``pending`` brings (they arrive while the kernel
        runs); returns the sums."""
        grads = None if self.call is None else self._run(None, None)
        summed = pending.wait()
        for acc, grad in zip(summed, grads or ()):
            add_rows(acc, self.call.keys, grad)
        return summed

    def write(self, targets) -> None:
        """Write the call's dK/dV into ``targets`` (full blocks: zero outside its keys);
        straight from the kernel when they have the kernel's dtype."""
        call = self.call
        if call is None:
            for t in targets:
                t.zero_()
            return
        for t in targets:
            zero_outside(t, call.keys)
        if targets[0].dtype == self.args[2].dtype:
            self._run(*targets)
            return
        for t, grad in zip(targets, self._run(None, None)):  # fp32 sums of bf16 gradients
            put_rows(t, call.keys, grad)

    def _run(self, dk, dv):
        dq = self.dq_sum.into(self.call.rows)
        grads = self.call.backward_into(self.kernel, (dq, dk, dv), *self.args)
        if dq is None:
            self.dq_sum.add(self.call.rows, grads[0])
        return grads[1:]
