"""``allgather``: context parallelism by gathering every rank's K/V (llama3, TE ``all_gather``).

Rank r holds the tokens ``partition.indices(S, P, r)`` of q, k, v. Forward on rank r:

    start all-gather of K and V ──┐   local block: own queries vs own keys
                                  │   (causal: the top-left mask over the local tokens)
    wait ◄────────────────────────┘
    others = the other ranks' K/V in global token order (the one copy)
    each run of consecutive local tokens [a, a+n) at local rows [o, o+n):
        rows [o, o+n) attend fully to others[:a - o], every other rank's token before a

load_balanced, P = 2, S = 16 in chunks of 4; rank 0 holds chunks 0 and 3 (tokens 0-3, 12-15):

    rows 0-3  (tokens 0-3)    others[:0]: nothing beyond the local block
    rows 4-7  (tokens 12-15)  others[:8]: tokens 4-11 of rank 1

Without causal, all local rows attend to all of ``others`` in one call. Every block is
folded into fp32 accumulators by ``fold``. Backward gathers K/V again (the forward
keeps nothing), runs the same calls with the global out and lse, accumulates dQ and the
dK/dV of every gathered token in fp32, and reduce-scatters dK/dV back to their owners.

Packed sequences: the same calls, each one varlen call over every sequence. The own call is
causal over each sequence's local real tokens; call k takes the k-th run of every sequence's
local tokens against the other ranks' real tokens of that sequence before the run (full
mask, so the keys may stay in the gathered order: rank, then local slot).
"""

from __future__ import annotations

import torch

from sdpa_fusion.kernels.base import layout_of
from sdpa_fusion.merge import Merged

from . import heads
from .base import Description
from .buffers import buffer_shape, from_buffer, to_buffer
from .calls import DenseCall, Sum, add_rows, as_block, as_packed, packed_call, part_call
from .memory import Memory, Sizes, backward_call, forward_call
from .sequence import SequenceSchedule

MAX_RUNS = 2  # causal: kernel calls per rank over the gathered K/V (one per run of tokens)


def runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) local rows of each run of consecutive global positions in ``indices``."""
    breaks = ((indices[1:] != indices[:-1] + 1).nonzero().flatten() + 1).tolist()
    bounds = [0, *breaks, len(indices)]
    return list(zip(bounds, bounds[1:]))


def gathered_calls(indices: torch.Tensor, kv_len: int, kv_local: int,
                   causal: bool) -> list[tuple[slice, int]]:
    """(local query rows, n) of every kernel call after the gather: the rows attend without a
    mask to the first n of the other ranks' keys in global order (pure; no call when n = 0)."""
    if not causal:
        n = kv_len - kv_local
        return [(slice(0, len(indices)), n)] if n else []
    calls = []
    for start, stop in runs(indices):
        before = int(indices[start]) - start  # tokens before the run held by other ranks
        if before:
            calls.append((slice(start, stop), before))
    return calls


def packed_runs(split) -> torch.Tensor:
    """[P, T_local]: the run of consecutive positions each real local token belongs to,
    counted from 0 in its sequence's part; -1 for padding."""
    pos, real, slot = split.positions, split.real, split.slot
    start = real.clone()
    start[:, 1:] &= (pos[:, 1:] != pos[:, :-1] + 1) | (slot[1:] == 0)
    seen = torch.cumsum(start.long(), dim=1)
    first = split.offsets[:-1].clamp(max=max(split.tokens - 1, 0))
    before = (seen - start.long())[:, first]  # runs of the earlier sequences' parts
    return torch.where(real, seen - 1 - before[:, split.seq], -1)


def packed_plan(packing, causal: bool):
    """(own call, gathered calls) of this rank on packed sequences; gathered calls take their
    keys from every rank's part, gathered in rank order ([P * T_local] rows)."""
    split, r = packing.split, packing.rank
    own = part_call(packing, r, (0, split.storage), (0, split.storage), causal)
    others = split.real.clone()
    others[r] = False
    keys = others.flatten().nonzero().flatten()
    key_seq, key_pos = split.seq.repeat(split.parts)[keys], split.positions.flatten()[keys]
    order = torch.sort(key_seq, stable=True).indices  # keys grouped by sequence
    keys, key_seq, key_pos = keys[order], key_seq[order], key_pos[order]
    mine = packed_runs(split)[r] if causal else torch.where(split.real[r], 0, -1)
    sequences, calls = len(split.lengths), []
    for run in range(int(mine.max()) + 1):
        rows = (mine == run).nonzero().flatten()
        seq = split.seq[rows]
        start = torch.full((sequences,), torch.iinfo(torch.long).max)
        if causal:  # the other ranks' tokens before the run
            start = start.scatter_reduce(0, seq, split.positions[r][rows], "amin")
        seen = key_pos < start[key_seq]
        call = packed_call(rows, torch.bincount(seq, minlength=sequences), keys[seen],
                           torch.bincount(key_seq[seen], minlength=sequences), causal=False,
                           tokens=(split.tokens, split.parts * split.tokens), device=split.device)
        if call is not None:
            calls.append(call)
    return own, calls


class AllGather(SequenceSchedule):
    name = "allgather"

    def validate(self, spec):
        super().validate(spec)
        if not spec.causal:
            return
        if spec.packing is not None:
            split = spec.packing.split
            most = spec.packing.cached("runs", lambda: int(packed_runs(split).max()) + 1)
            what = "a sequence's part"
        else:
            q_len = spec.q_len * self.size
            most = max(len(runs(self.indices(q_len, r))) for r in range(self.size))
            what = f"a {q_len}-token sequence"
        if most > MAX_RUNS:
            raise ValueError(
                f"schedule 'allgather' with causal=True makes one kernel call per run of "
                f"consecutive tokens a rank holds, at most {MAX_RUNS}; partition "
                f"{self.partition.name!r} gives a rank {most} runs of {what} "
                f"over {self.size} ranks. Use partition='load_balanced' or 'contiguous' (or "
                f"schedule 'ring' for 'striped')"
            )

    def _packed_plan(self, packing, causal: bool):
        return packing.cached(("allgather", causal), lambda: packed_plan(packing, causal))

    def _calls(self, q_len: int, kv_len: int, causal: bool):
        return gathered_calls(self.indices(q_len), kv_len, kv_len // self.size, causal)

    def _plan(self, spec, q_len: int):
        """(the own call, the calls over the gathered keys) of this rank: dense calls take
        the other ranks' keys in global order (``_others``), packed calls every rank's keys
        in rank order."""
        if spec.packing is not None:
            return self._packed_plan(spec.packing, spec.causal)
        q_full, kv_full = q_len * self.size, spec.kv_len * self.size
        own = DenseCall(slice(None), slice(None), spec.causal)
        return own, [DenseCall(rows, slice(0, n), False)
                     for rows, n in self._calls(q_full, kv_full, spec.causal)]

    def _other_positions(self, kv_len: int, device):
        """(rank, where its tokens go in ``others``) for every other rank."""
        positions = self.positions(kv_len, device)
        kept = torch.ones(kv_len, dtype=torch.long, device=device)
        kept[positions[self.index]] = 0
        slot = kept.cumsum(0) - 1
        return [(j, slot[positions[j]]) for j in range(self.size) if j != self.index]

    def _gathers(self, spec, k, v, groups):
        """(group, its K and V as the calls take them) for every head group; each group's
        gather is started while the group before is attended."""
        layout = layout_of(k)
        positions = None if spec.packing else self._other_positions(k.shape[2] * self.size,
                                                                    k.device)

        def start(g):
            if spec.packing is not None:
                return [self.comm.all_gather(as_packed(g.of_kv(t))) for t in (k, v)]
            return [self.comm.all_gather(to_buffer(g.of_kv(t), layout)) for t in (k, v)]

        pending = start(groups[0])
        for index, g in enumerate(groups):
            gathered, pending = [p.wait() for p in pending], None
            if spec.packing is not None:
                keys = [as_block(t.flatten(0, 1)) for t in gathered]
            else:
                keys = [self._others(t, positions, layout) for t in gathered]
            del gathered
            if index + 1 < len(groups):
                pending = start(groups[index + 1])
            yield g, keys, positions
            del keys

    def _others(self, gathered: torch.Tensor, positions, layout) -> torch.Tensor:
        """The other ranks' tokens of a gathered [P, *buffer] tensor, in global token order."""
        b, h, s_local, e = from_buffer(gathered[0], layout).shape
        others = layout.empty((b, h, s_local * (self.size - 1), e), dtype=gathered.dtype,
                              device=gathered.device)
        for j, slots in positions:
            others.index_copy_(2, slots, from_buffer(gathered[j], layout))
        return others

    def forward(self, q, k, v, spec, kernel, dropout=None):
        packed = spec.packing is not None
        if packed:
            q, k, v = (as_block(t) for t in (q, k, v))
        own, calls = self._plan(spec, q.shape[2])
        out = layout_of(q).empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        groups, scale = self.groups_of(q, k), spec.softmax_scale
        for g, gathered, _ in self._gathers(spec, k, v, groups):
            merged = Merged(g.of_q(out), g.of_q(lse), blocks=2)  # own + one call per row
            _attend(own, kernel, merged, g.of_q(q), (g.of_kv(k), g.of_kv(v)), scale)
            for call in calls:
                _attend(call, kernel, merged, g.of_q(q), gathered, scale)
            merged.finish()
            del gathered
        return (as_packed(out) if packed else out), lse

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        packed = spec.packing is not None
        if packed:
            dout, q, k, v, out = (as_block(t) for t in (dout, q, k, v, out))
        own, calls = self._plan(spec, q.shape[2])
        dq, dk, dv = (layout_of(t).empty(t.shape, dtype=t.dtype, device=t.device)
                      for t in (q, k, v))
        groups, scale = self.groups_of(q, k), spec.softmax_scale
        for g, keys, positions in self._gathers(spec, k, v, groups):
            args = [g.of_q(t) for t in (dout, q)], [g.of_q(t) for t in (out, lse)]
            dq_sum = Sum(g.of_q(dq), 2)  # own + one call per row
            own_grads = list(_grads(own, kernel, dq_sum, (g.of_kv(k), g.of_kv(v)), args, scale))
            sums = _sums(calls, kernel, dq_sum, keys, args, scale)
            del keys
            dq_sum.finish()
            for target in (g.of_kv(dk), g.of_kv(dv)):  # one at a time: dK, then dV
                own_grad = own_grads.pop(0) if own_grads else None
                if packed:
                    mine = self._packed_scatter(own_grad, own and own.keys, sums.pop(0))
                else:
                    mine = self._scatter(own_grad, sums.pop(0), positions, target)
                target.copy_(mine)
                del own_grad, mine
        if packed:
            dq, dk, dv = (as_packed(t) for t in (dq, dk, dv))
        return dq, dk, dv

    def _scatter(self, own, others, positions, like):
        """This rank's tokens' dK (or dV), fp32, of a head group: every rank's gradients of
        them, summed (``own``: this rank's own, None for none; ``others``: its fp32 sums of
        the other ranks' tokens, in ``_others`` order); ``like``: the local tensor's layout."""
        layout = layout_of(like)
        send = torch.empty((self.size, *buffer_shape(like.shape, layout)), dtype=torch.float32,
                           device=like.device)
        for j, slots in positions:
            torch.index_select(others, 2, slots, out=from_buffer(send[j], layout))
        del others
        mine = from_buffer(send[self.index], layout)
        if own is None:
            mine.zero_()
        else:
            mine.copy_(own)
        return from_buffer(self.comm.reduce_scatter(send), layout)

    def _packed_scatter(self, own, own_keys, summed):
        """This rank's tokens' dK (or dV) of a head group: the fp32 sums of every rank's
        tokens (rank order), with this rank's own gradients added, reduce-scattered."""
        tokens = summed.shape[2] // self.size
        if own is not None:
            add_rows(summed[:, :, self.index * tokens:(self.index + 1) * tokens], own_keys, own)
        return as_block(self.comm.reduce_scatter(as_packed(summed).unflatten(0, (self.size, tokens))))

    def describe(self, spec):
        p, itemsize = self.size, spec.dtype.itemsize
        kv = 2 * spec.batch * spec.kv_heads * self.local_tokens(spec) * spec.head_dim
        gather, scatter = (p - 1) * kv * itemsize, (p - 1) * kv * 4
        steps, pairs = self._work(spec)
        flops = 4.0 * spec.batch * spec.heads * spec.head_dim * pairs
        return Description(
            self.name, p, steps=steps, bytes_sent=gather, bytes_received=gather,
            flops=flops, backward_steps=steps, backward_bytes_sent=gather + scatter,
            backward_bytes_received=gather + scatter, backward_flops=2.5 * flops,
            notes=f"partition {self.partition.name}; steps are kernel calls, flops this rank's; "
                  f"K/V all-gathered again in backward, fp32 dK/dV reduce-scattered; "
                  f"{self.groups_for(spec)} head group(s)",
            memory=self.memory(spec),
        )

    def memory(self, spec) -> Memory:
        """What this rank allocates for a call on the global ``spec``, per head group: every
        rank's K/V as gathered and the other ranks' in token order (the next group's gather
        meanwhile in flight); backward adds the own dK/dV, fp32 sums of the gathered keys'
        dK/dV and, per tensor, the fp32 input and output of the reduce-scatter."""
        p, rows = self.size, self.local_tokens(spec)
        packed = spec.layout.is_varlen
        groups = self.groups_for(spec)
        size, whole = Sizes(spec, rows, groups), Sizes(spec, rows)
        kv, kv32 = size.kv(), size.kv(itemsize=4)
        copies = 0 if heads.contiguous(spec, groups) else 2 * kv  # what a gather sends
        gathered = 2 * p * kv + copies
        # packed calls read the gathered K/V itself; dense ones the others in token order
        keys = 2 * p * kv if packed else 2 * (p - 1) * kv
        building = gathered if packed else gathered + keys
        ahead = gathered if groups > 1 else 0  # the next group's gather
        key_rows = (p if packed else p - 1) * rows
        own, calls = self._plan(self.local_spec(spec), rows)
        calls = [c for c in calls if c is not None]
        own_keys = [] if own is None else [(own, rows)]
        forward = max(building, keys + ahead + max(
            (forward_call(size, c, n, spec.dtype.itemsize)
             for c, n in [*own_keys, *((c, key_rows) for c in calls)]), default=0))
        sums = 2 * (key_rows // rows) * kv32
        calls_step = max((backward_call(size, c, key_rows, dq_temp=True, kv_temps=True)
                          for c in calls), default=0)
        own_step = max((backward_call(size, c, n, dq_temp=False, kv_temps=True)
                        for c, n in own_keys), default=0)
        own_grads = 2 * kv if own is not None else 0
        scatter = kv32 if packed else p * kv32  # the reduce-scatter's input beside the sums
        backward = whole.q() + 2 * whole.kv() + max(
            building, keys + ahead + own_step, keys + ahead + own_grads + sums + calls_step,
            ahead + own_grads + sums + scatter)
        return Memory(outputs=whole.q() + whole.lse(), forward=forward, backward=backward)

    def _work(self, spec) -> tuple[int, float]:
        """(kernel calls, query-key pairs) of this rank for the global ``spec``."""
        if spec.layout.is_varlen:
            split = self.split(spec.cu_seqlens, spec.cu_seqlens_padded, "cpu")
            own, calls = packed_plan(split.part(self.index), spec.causal)
            done = [c for c in (own, *calls) if c is not None]
            return len(done), sum(c.pairs for c in done)
        q_local = spec.q_len // self.size
        calls = self._calls(spec.q_len, spec.kv_len, spec.causal)
        pairs = q_local * (spec.kv_len // self.size) * (0.5 if spec.causal else 1.0)
        return 1 + len(calls), pairs + sum((rows.stop - rows.start) * n for rows, n in calls)


def _attend(call, kernel, merged: Merged, q, keys, scale) -> None:
    """Fold a call's (out, lse) over ``keys`` into ``merged`` (nothing without a call)."""
    if call is not None:
        merged.add(*call.forward(kernel, q, *keys, scale), rows=call.rows)


def _sums(calls, kernel, dq_sum: Sum, keys, args, scale) -> list[torch.Tensor]:
    """fp32 sums of the calls' dK and dV over ``keys``; their dQ goes into ``dq_sum``."""
    sums = [torch.zeros_like(t, dtype=torch.float32) for t in keys]
    for call in calls:
        for acc, grad in zip(sums, _grads(call, kernel, dq_sum, keys, args, scale)):
            add_rows(acc, call.keys, grad)
    return sums


def _grads(call, kernel, dq_sum: Sum, keys, args, scale):
    """(dK, dV) of a call over ``keys`` (none without a call); its dQ goes into ``dq_sum``."""
    if call is None:
        return ()
    (dout, q), (out, lse) = args
    dq = dq_sum.into(call.rows)
    dq_b, *grads = call.backward_into(kernel, (dq, None, None), dout, q, *keys, out, lse, scale)
    if dq is None:
        dq_sum.add(call.rows, dq_b)
    return grads

