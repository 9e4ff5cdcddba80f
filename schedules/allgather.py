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

Sliding windows: the own block and every other rank's block (``others`` then in rank order)
are split into the calls of ``schedules.bands``, each a window in its own coordinates; blocks
the window does not reach make no call.
"""

from __future__ import annotations

import functools

import torch

from sdpa_fusion.kernels.base import layout_of
from sdpa_fusion.merge import accumulators, finish

from .bands import (check_runs, dense_calls, dense_runs, packed_calls, run_index, spec_runs,
                    window_band)
from .base import Description
from .buffers import buffer_shape, from_buffer, to_buffer
from .calls import (DenseCall, as_block, as_packed, backward_calls, fold_calls, packed_call,
                    part_call)
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
    return run_index(split.positions, split.real, split.seq)


def packed_plan(packing, causal: bool):
    """(own calls, gathered calls) of this rank on packed sequences; gathered calls take their
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
    return [own] if own is not None else [], calls


def window_plan(spec, mask, partition, parts: int, rank: int):
    """(own calls, gathered calls) of ``rank`` under the band ``mask``: ``bands`` calls of its
    block and of every other rank's block (rank order: dense ``others``, packed gathered)."""
    packing = spec.packing
    if packing is None:
        return _dense_window_plan(mask, partition, parts, rank, spec.q_len, spec.kv_len)
    runs, _ = spec_runs(spec, partition, parts)
    t, device = packing.tokens, packing.device
    own = packed_calls(runs, rank, rank, mask, tokens=(t, t), device=device)
    return own, [call for j in range(parts) if j != rank
                 for call in packed_calls(runs, rank, j, mask, tokens=(t, parts * t),
                                          device=device, key_base=j * t)]


@functools.lru_cache(maxsize=64)
def _dense_window_plan(mask, partition, parts, rank, s_q, s_kv):
    """``window_plan`` of a dense rank holding ``s_q`` queries and ``s_kv`` keys."""
    runs_q = dense_runs(partition, s_q * parts, parts)
    runs_k = dense_runs(partition, s_kv * parts, parts)
    others = [j for j in range(parts) if j != rank]
    own = dense_calls(runs_q, rank, runs_k, rank, mask)
    return own, [call for slot, j in enumerate(others)
                 for call in dense_calls(runs_q, rank, runs_k, j, mask, key_base=slot * s_kv)]


class AllGather(SequenceSchedule):
    name = "allgather"

    def validate(self, spec):
        super().validate(spec)
        if window_band(spec) is not None:  # causal is part of the window's band
            check_runs(spec, self.partition, self.size, self.name)
            return
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

    def _plan(self, spec):
        """(own calls, calls over the gathered keys, others in rank order) of this rank's
        local ``spec``: ``others`` holds the other ranks' tokens in global order, or in rank
        order under a window. Packed plans are made once per packing."""
        mask, packing = window_band(spec), spec.packing
        if mask is not None:
            build = functools.partial(window_plan, spec, mask, self.partition, self.size,
                                      self.index)
            if packing is None:
                return (*build(), True)
            return (*packing.cached(("allgather", mask), build), True)
        if packing is not None:
            return (*packing.cached(("allgather", spec.causal),
                                    lambda: packed_plan(packing, spec.causal)), False)
        own = [DenseCall(slice(None), slice(None), spec.causal)]
        q_len, kv_len = spec.q_len * self.size, spec.kv_len * self.size
        calls = gathered_calls(self.indices(q_len), kv_len, spec.kv_len, spec.causal)
        return own, [DenseCall(rows, slice(0, n), False) for rows, n in calls], False

    def _streams(self, dropout, part: str):
        """The dropout streams of this rank's ``part`` ("own" or "gathered") of kernel calls,
        one per call (``streams(i)``); None without dropout."""
        if dropout is None:
            return None
        return lambda call: dropout.stream("allgather", self.index, part, call)

    def _other_positions(self, kv_len: int, device, rank_order: bool):
        """(rank, where its tokens go in ``others``) for every other rank."""
        if rank_order:
            s_local = kv_len // self.size
            others = [j for j in range(self.size) if j != self.index]
            return [(j, torch.arange(slot * s_local, (slot + 1) * s_local, device=device))
                    for slot, j in enumerate(others)]
        positions = self.positions(kv_len, device)
        kept = torch.ones(kv_len, dtype=torch.long, device=device)
        kept[positions[self.index]] = 0
        slot = kept.cumsum(0) - 1
        return [(j, slot[positions[j]]) for j in range(self.size) if j != self.index]

    def _others(self, gathered: torch.Tensor, positions, layout) -> torch.Tensor:
        """The other ranks' tokens of a gathered [P, *buffer] tensor, in global token order."""
        b, h, s_local, e = from_buffer(gathered[0], layout).shape
        others = layout.empty((b, h, s_local * (self.size - 1), e), dtype=gathered.dtype,
                              device=gathered.device)
        for j, slots in positions:
            others.index_copy_(2, slots, from_buffer(gathered[j], layout))
        return others

    def _start_gather(self, k, v, layout, rank_order: bool):
        """Start gathering K and V; also return where the other ranks' tokens go in ``others``."""
        pending = [self.comm.all_gather(to_buffer(t, layout)) for t in (k, v)]
        return pending, self._other_positions(k.shape[2] * self.size, k.device, rank_order)

    def forward(self, q, k, v, spec, kernel, dropout=None):
        if spec.packing is not None:
            return self._packed_forward(q, k, v, spec, kernel)
        layout, scale = spec.layout, spec.softmax_scale
        own, calls, rank_order = self._plan(spec)
        pending, positions = self._start_gather(k, v, layout, rank_order)
        out_acc, lse_acc = fold_calls(own, kernel, q, k, v, scale, *accumulators(q, layout),
                                      self._streams(dropout, "own"))
        k_o, v_o = (self._others(p.wait(), positions, layout) for p in pending)
        out_acc, lse_acc = fold_calls(calls, kernel, q, k_o, v_o, scale, out_acc, lse_acc,
                                      self._streams(dropout, "gathered"))
        return finish(out_acc, q.dtype, layout), lse_acc

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        if spec.packing is not None:
            return self._packed_backward(dout, q, k, v, out, lse, spec, kernel)
        layout, scale = spec.layout, spec.softmax_scale
        own, calls, rank_order = self._plan(spec)
        pending, positions = self._start_gather(k, v, layout, rank_order)
        dq, *mine = (accumulators(t, layout)[0] for t in (q, k, v))
        backward_calls(own, kernel, dout, q, k, v, out, lse, scale, dq, mine,
                       self._streams(dropout, "own"))
        k_o, v_o = (self._others(p.wait(), positions, layout) for p in pending)
        others = [torch.zeros_like(t, dtype=torch.float32) for t in (k_o, v_o)]
        backward_calls(calls, kernel, dout, q, k_o, v_o, out, lse, scale, dq, others,
                       self._streams(dropout, "gathered"))
        dk, dv = self._reduce_scatter(mine, others, positions, layout)
        return finish(dq, q.dtype, layout), finish(dk, k.dtype, layout), finish(dv, v.dtype, layout)

    def _reduce_scatter(self, own, others, positions, layout):
        """dK, dV (fp32) of this rank's tokens: every rank's gradients of them, summed."""
        shape = buffer_shape(own[0].shape, layout)
        send = torch.empty((self.size, len(own), *shape), dtype=torch.float32, device=own[0].device)
        for i, (g_own, g_others) in enumerate(zip(own, others)):
            from_buffer(send[self.index, i], layout).copy_(g_own)
            for j, slots in positions:
                torch.index_select(g_others, 2, slots, out=from_buffer(send[j, i], layout))
        mine = self.comm.reduce_scatter(send)
        return [from_buffer(g, layout) for g in mine]

    def _packed_forward(self, q, k, v, spec, kernel):
        own, calls, _ = self._plan(spec)
        pending = [self.comm.all_gather(t) for t in (k, v)]
        q, k, v = (as_block(t) for t in (q, k, v))
        scale = spec.softmax_scale
        out_acc, lse_acc = fold_calls(own, kernel, q, k, v, scale, *accumulators(q))
        k_all, v_all = (as_block(p.wait().flatten(0, 1)) for p in pending)
        out_acc, lse_acc = fold_calls(calls, kernel, q, k_all, v_all, scale, out_acc, lse_acc)
        return as_packed(finish(out_acc, q.dtype, layout_of(q))), lse_acc

    def _packed_backward(self, dout, q, k, v, out, lse, spec, kernel):
        own, calls, _ = self._plan(spec)
        pending = [self.comm.all_gather(t) for t in (k, v)]
        tokens, scale = k.shape[0], spec.softmax_scale
        dout, q, k, v, out = (as_block(t) for t in (dout, q, k, v, out))
        dq = accumulators(q)[0]
        # fp32 dK/dV of every gathered token: [dK | dV] x [rank 0 | rank 1 | ...]
        sums = torch.zeros((2, self.size * tokens, *k.shape[1::2]), dtype=torch.float32,
                           device=k.device)
        mine = [as_block(acc[self.index * tokens:(self.index + 1) * tokens]) for acc in sums]
        backward_calls(own, kernel, dout, q, k, v, out, lse, scale, dq, mine)
        k_all, v_all = (as_block(p.wait().flatten(0, 1)) for p in pending)
        backward_calls(calls, kernel, dout, q, k_all, v_all, out, lse, scale, dq,
                       [as_block(acc) for acc in sums])
        dk, dv = self.comm.reduce_scatter(sums.unflatten(1, (self.size, tokens)).transpose(0, 1))
        return (as_packed(finish(dq, q.dtype, layout_of(q))),
                dk.to(k.dtype), dv.to(v.dtype))

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
                  f"K/V all-gathered again in backward, fp32 dK/dV reduce-scattered",
        )

    def _work(self, spec) -> tuple[int, float]:
        """(kernel calls, query-key pairs) of this rank for the global ``spec``."""
        local = self.local_spec(spec)
        own, calls, _ = self._plan(local)
        if spec.layout.is_varlen:
            return len(own) + len(calls), sum(c.pairs for c in own + calls)
        pairs = sum(c.pairs(local.q_len, local.kv_len) for c in own) + \
            sum(c.pairs(local.q_len, spec.kv_len - local.kv_len) for c in calls)
        return len(own) + len(calls), pairs
