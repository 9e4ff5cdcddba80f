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

Without causal, all local rows attend to all of ``others`` in one call. Backward gathers
K/V again (the forward keeps nothing), runs the same calls with the global out and lse, and
reduce-scatters the fp32 dK/dV sums back to their owners. Head groups (``schedules.heads``)
run in turn, the next group's gather in flight while the current one is attended.

Packed sequences: the same calls, each one varlen call over every sequence, the gathered
keys in rank order (the calls over them have no mask). They travel through ``transport``:
each rank puts its K/V of a group into every other rank's region (two regions in turn), and
its dK/dV sums of the other ranks' tokens into theirs, in the input dtype where the gathered
calls' key sets are disjoint (each sum one kernel gradient). A group's sums land after the
next group's own calls are queued, so over copy engines all but the first and last group's
transfers travel beside the attention kernels. (``auto`` adds no groups for that: on packed
batch (a) over 2 H200 one group ran at 0.77 of one GPU, two at 0.76, four at 0.75.)

Composed masks (``mask=``, ``schedules.mask_plans``) and sliding windows (``schedules.bands``):
the calls of the own block and of every other rank's block, ``others`` then in rank order.

All of the above is a plan (``AllGather.plan``: the ops of ``schedules.runner``; the gathers
and scatters are its ``_Transfers``).
"""

from __future__ import annotations

import functools

import torch

from sdpa_fusion.kernels.base import layout_of

from . import dry_run, mask_plans, runner
from .assign import RING
from .bands import (check_runs, dense_calls, dense_runs, packed_calls, run_index, spec_runs,
                    window_band)
from .base import Description
from .buffers import buffer_shape, from_buffer, to_buffer
from .calls import (DenseCall, Sum, add_rows, as_block, as_packed, packed_call, part_call,
                    row_index)
from .overlap import Overlap
from .sequence import SequenceSchedule
from .transport import InFlight, Put, Take, Transported, rows_at, sections
from .whole import whole_documents

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
    """(own calls, gathered calls) of this rank on packed sequences, the gathered keys in rank
    order. Every local row sees the other ranks' tokens of its sequence before its run; rows
    of a sequence that see the same keys share one call (at P = 2 both runs of a rank do)."""
    split, r = packing.split, packing.rank
    own = part_call(packing, r, (0, split.storage), (0, split.storage), causal)
    others = split.real.clone()
    others[r] = False
    keys = others.flatten().nonzero().flatten()
    key_seq, key_pos = split.seq.repeat(split.parts)[keys], split.positions.flatten()[keys]
    order = torch.sort(key_seq, stable=True).indices  # keys grouped by sequence
    keys, key_seq, key_pos = keys[order], key_seq[order], key_pos[order]
    mine = packed_runs(split)[r] if causal else torch.where(split.real[r], 0, -1)
    rows = (mine >= 0).nonzero().flatten()
    seq, sequences = split.seq[rows], len(split.lengths)
    width = int(split.positions.max()) + 2 if split.positions.numel() else 2
    if causal:  # a row sees the keys before the first position of its run in its sequence
        runs = int(mine.max()) + 1
        group = seq * runs + mine[rows]
        first = torch.full((sequences * runs,), width).scatter_reduce(
            0, group, split.positions[r][rows], "amin")
        before = first[group]
    else:
        before = torch.full_like(rows, width)
    # how many keys each row sees (keys sorted by sequence, then position)
    ranked = torch.sort(key_seq * width + key_pos).values
    seen = torch.searchsorted(ranked, seq * width + before) \
        - torch.searchsorted(ranked, seq * width)
    rows, seq, before, seen = (t[seen > 0] for t in (rows, seq, before, seen))
    # rows of a sequence that see as many keys see the same ones: one slot per count
    kinds, kind = torch.unique(seq * (len(keys) + 1) + seen, return_inverse=True)
    slot_of_kind = torch.arange(len(kinds)) - torch.searchsorted(
        kinds, kinds // (len(keys) + 1) * (len(keys) + 1))
    slot = slot_of_kind[kind]
    calls = []
    for i in range(int(slot.max()) + 1 if len(slot) else 0):
        chosen = slot == i
        limit = torch.zeros(sequences, dtype=torch.long).scatter_reduce(
            0, seq[chosen], before[chosen], "amax")
        taken = key_pos < limit[key_seq]
        call = packed_call(rows[chosen], torch.bincount(seq[chosen], minlength=sequences),
                           keys[taken], torch.bincount(key_seq[taken], minlength=sequences),
                           causal=False, tokens=(split.tokens, split.parts * split.tokens),
                           device=split.device)
        if call is not None:
            calls.append(call)
    return [own] if own is not None else [], calls


def window_plan(spec, mask, partition, parts: int, rank: int):
    """(own calls, gathered calls in rank order) of ``rank`` under the band ``mask``."""
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


@whole_documents
class AllGather(Transported, SequenceSchedule):
    """K/V all-gathered per head group; packed K/V and sums travel by ``transport``."""

    name = "allgather"
    overlap = Overlap(hidden=lambda p: 1 / p, splits_keys=True)  # the own block hides the gather
    exchange = RING  # priced as the ring's (no fit of its own)

    def __init__(self, mesh, *, dim=None, partition="auto", transport="auto",
                 head_groups="auto"):
        super().__init__(mesh, dim=dim, partition=partition, head_groups=head_groups)
        self.use_transport(transport)

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

    def kernel_calls(self, spec) -> int:
        """The kernel calls this rank makes on the local ``spec``: on its own keys and on the
        gathered ones."""
        own, calls, _ = self._plan(spec)
        return max(1, len(own) + len(calls))

    def _plan(self, spec):
        """(own calls, gathered calls, whether ``others`` is in rank order) of this rank."""
        mask, packing = window_band(spec), spec.packing
        rank = self.index if packing is None else packing.rank  # packed: the packing's rank
        if spec.mask is not None:  # a composed mask: the MaskedCalls, others in rank order
            return (*mask_plans.allgather_plan(spec, self.partition, self.size, rank), True)
        if mask is not None:
            build = functools.partial(window_plan, spec, mask, self.partition, self.size, rank)
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

    def _sums_dtype(self, local) -> torch.dtype:
        """The dtype the gathered keys' dK/dV sums travel in: the input's where every rank's
        gathered calls have disjoint key sets (each sum one kernel gradient), else fp32."""
        packing = local.packing
        if packing is None or local.dtype == torch.float32:
            return torch.float32

        def disjoint_on(rank):
            calls = self._plan(local.replace(packing=packing.split.part(rank)))[1]
            keys = [row_index(c.keys, self.size * packing.tokens) for c in calls]
            every = torch.cat(keys) if keys else torch.empty(0)
            return len(every.unique()) == len(every)

        key = ("allgather-disjoint", local.causal, window_band(local))
        disjoint = packing.cached(key, lambda: all(map(disjoint_on, range(self.size))))
        return local.dtype if disjoint else torch.float32

    # ---- the plan ------------------------------------------------------------------------
    def plan(self, spec, q, k, *, backward: bool) -> runner.Plan:
        """This rank's ``runner.Plan`` of a forward (or ``backward``) on the local ``spec``."""
        own, calls, rank_order = self._plan(spec)
        groups = len(self.groups_of(q, k, spec))
        # the most calls a row gets: the own and one gathered (their rows are apart runs);
        # under a window or mask any call may reach a row
        blocks = len(own) + len(calls) if rank_order else 2
        transfers = _Transfers(self, spec, rank_order)
        if not backward:
            return runner.Plan(self._forward_ops(own, calls, groups, blocks), groups,
                               transfers=transfers)
        return runner.Plan(self._backward_ops(own, calls, groups, blocks, spec.packing is not None),
                           groups, sums=(self._sums_dtype(spec), 0), transfers=transfers)

    def _stream(self, part: str, group: int) -> tuple:
        """The dropout stream key of this rank's ``part`` ("own" or "gathered") of calls."""
        return "allgather", self.index, part, group

    def _forward_ops(self, own, calls, groups: int, blocks: int) -> tuple:
        ops = [runner.Gather(0)]
        for g in range(groups):
            ops += [runner.KV(g), runner.Open(g, blocks),
                    runner.Fold(tuple(own), self._stream("own", g)), runner.KV(g, arrives=True)]
            if g + 1 < groups:
                ops.append(runner.Gather(g + 1))
            ops += [runner.Fold(tuple(calls), self._stream("gathered", g)), runner.Finish()]
        return tuple(ops)

    def _backward_ops(self, own, calls, groups: int, blocks: int, packed: bool) -> tuple:
        """Backward: the own calls' dK/dV kept (PARTS), the gathered calls' sums (SUMS) sent
        home, packed ones landing behind the next group's own calls (the last group runs its
        own calls after the gathered ones, while its sums travel)."""
        ops = [runner.Gather(0)]
        for g in range(groups):
            own_first = not packed or g < groups - 1
            own_grads = [runner.KV(g), runner.Grads(tuple(own), self._stream("own", g),
                                                    runner.PARTS)]
            ops.append(runner.OpenDq(g, contributions=blocks))
            if own_first:
                ops += own_grads
                if packed and g:
                    ops.append(runner.Land(g - 1))
            ops.append(runner.KV(g, arrives=True))
            if g + 1 < groups:
                ops.append(runner.Gather(g + 1))
            ops += [runner.Grads(tuple(calls), self._stream("gathered", g), runner.SUMS),
                    runner.Drop()]
            if not packed:
                ops += [runner.FinishDq(), runner.Scatter(g)]
                continue
            if not own_first and g:
                ops.append(runner.Land(g - 1))
            ops.append(runner.StartScatter(g))
            if not own_first:
                ops += own_grads
            ops.append(runner.FinishDq())
        if packed:
            ops.append(runner.Land(groups - 1))
        return tuple(ops)

    def describe(self, spec):
        """Bytes counted on this rank's plans for the global ``spec``; steps (kernel calls)
        and FLOPs (query-key pairs) from its calls."""
        forward, backward = runner.plans_of(self, spec)
        sums = backward.sums[0]

        def others(plan, dtype) -> int:  # bytes of one group's K and V of the other ranks
            return plan.kv_bytes(spec, (self.size - 1) * self.local_tokens(spec), dtype)

        gather = forward.count(runner.Gather) * others(forward, spec.dtype)
        back = backward.count(runner.Gather) * others(backward, spec.dtype) + \
            backward.count(runner.Scatter, runner.StartScatter) * others(backward, sums)
        local = self.local_spec(spec)
        own, calls, _ = self._plan(local)
        steps = len(own) + len(calls)
        if spec.layout.is_varlen or spec.mask is not None:
            pairs = sum(c.pairs for c in own + calls)
        else:
            pairs = sum(c.pairs(local.q_len, local.kv_len) for c in own) + \
                sum(c.pairs(local.q_len, spec.kv_len - local.kv_len) for c in calls)
        flops = 4.0 * spec.batch * spec.heads * spec.head_dim * pairs
        return Description(
            self.name, self.size, steps=steps, bytes_sent=gather, bytes_received=gather,
            flops=flops, backward_steps=steps, backward_bytes_sent=back,
            backward_bytes_received=back, backward_flops=2.5 * flops,
            notes=f"partition {self.partition.name}; steps are kernel calls, flops this rank's; "
                  f"K/V all-gathered again in backward, dK/dV sums reduce-scattered in "
                  f"{str(sums).replace('torch.', '')}; "
                  f"{self.groups_for(spec)} head group(s)"
                  + (f"; packed through transport {self.transport}" if spec.layout.is_varlen
                     else ""),
            memory_of=dry_run.memory_of(self, spec),
        )


class _Transfers:
    """How one call's K/V is gathered and its sums go home (``runner.Plan.transfers``)."""

    def __init__(self, schedule: AllGather, spec, rank_order: bool):
        self.schedule, self.spec, self.rank_order = schedule, spec, rank_order
        self.size, self.index = schedule.size, schedule.index
        self.packed = spec.packing is not None
        self.positions = None

    def begin(self, tensors, groups, backward: bool) -> None:
        self.tensors, self.groups = tensors, groups
        if not self.packed:
            return
        k = tensors["k"]
        self.gathers = 2 * self._region_bytes(k.dtype)
        scatter = self._region_bytes(self.schedule._sums_dtype(self.spec)) if backward else 0
        self.schedule.mover(k.device).reserve(self.gathers + scatter, k.device)

    # ---- K/V to every rank -------------------------------------------------------------------
    def gather(self, g):
        """Start gathering group ``g``'s K and V; ``wait()`` gives them in the calls' order."""
        k, v = self.tensors["k"], self.tensors["v"]
        if self.packed:
            return self._packed_gather(g, k, v)
        layout = layout_of(k)
        if self.positions is None:
            self.positions = self._other_positions(k.shape[2] * self.size, k.device)
        pending = [self.schedule.comm.all_gather(to_buffer(g.of_kv(t), layout)) for t in (k, v)]
        return runner.Arriving(lambda: [self._others(p.wait(), layout) for p in pending])

    def _other_positions(self, kv_len: int, device):
        """(rank, where its tokens go in ``others``) for every other rank."""
        if self.rank_order:
            s_local = kv_len // self.size
            others = [j for j in range(self.size) if j != self.index]
            return [(j, torch.arange(slot * s_local, (slot + 1) * s_local, device=device))
                    for slot, j in enumerate(others)]
        positions = self.schedule.positions(kv_len, device)
        kept = torch.ones(kv_len, dtype=torch.long, device=device)
        kept[positions[self.index]] = 0
        slot = kept.cumsum(0) - 1
        return [(j, slot[positions[j]]) for j in range(self.size) if j != self.index]

    def _others(self, gathered: torch.Tensor, layout) -> torch.Tensor:
        """The other ranks' tokens of a gathered [P, *buffer] tensor, placed by ``positions``."""
        b, h, s_local, e = from_buffer(gathered[0], layout).shape
        others = layout.empty((b, h, s_local * (self.size - 1), e), dtype=gathered.dtype,
                              device=gathered.device)
        for j, slots in self.positions:
            others.index_copy_(2, slots, from_buffer(gathered[j], layout))
        return others

    def _packed_gather(self, g, k, v):
        p, tokens = self.size, k.shape[2]
        item = (k.shape[1] // len(self.groups), k.shape[3], k.dtype)
        sends = [as_packed(g.of_kv(t)).contiguous() if p > 1 else None
                 for t in (k, v)]  # alone: nothing to send
        base = g.index % 2 * self._region_bytes(k.dtype)
        pending, offsets = self._to_slots([[send] * p for send in sends], item, tokens, base,
                                          k.device)
        # no rank puts the own slot's rows, and no call reads them: the plain plan gathers
        # the other ranks' keys only, a composed mask's takes them for padding (never read)
        in_flight = InFlight(pending, lambda flat: [as_block(rows_at(flat, at, p * tokens, item))
                                                    for at in offsets])
        return runner.Arriving(in_flight.finish)

    def _region_bytes(self, dtype) -> int:
        """Bytes of a region of a group's packed K and V (or sums) of every rank in ``dtype``."""
        k = self.tensors["k"]
        item = (k.shape[1] // len(self.groups), k.shape[3], dtype)
        return sections([item, item], self.size * k.shape[2])[1]

    def _to_slots(self, parts, item, tokens: int, base: int, device):
        """Start putting ``parts[i][j]`` into this rank's slot of tensor i in rank j's region."""
        p, me = self.size, self.index
        offsets, nbytes = sections([item] * len(parts), p * tokens)
        row = item[0] * item[1] * item[2].itemsize
        mover = self.schedule.mover(device)
        region = mover.region(base, nbytes, device)
        puts, takes = [], []
        for pieces, at in zip(parts, offsets):
            for j in range(p):
                if j != me:
                    puts.append(Put(pieces[j], (j - me) % p, at + me * tokens * row))
                    takes.append(Take((me - j) % p, at + j * tokens * row, tokens * row))
        return mover.exchange(puts, takes, region), offsets

    # ---- dK/dV home --------------------------------------------------------------------------
    def _targets(self, g):
        return [g.of_kv(self.tensors["dk"]), g.of_kv(self.tensors["dv"])]

    def scatter(self, g, parts, sums) -> None:
        """Dense: this rank's own ``parts`` and every rank's ``sums`` of the gathered keys,
        summed in fp32 by a reduce-scatter, into dK and dV."""
        for target in self._targets(g):
            layout, own = layout_of(target), parts.pop(0)
            send = torch.empty((self.size, *buffer_shape(target.shape, layout)),
                               dtype=torch.float32, device=target.device)
            for j, slots in self.positions:
                torch.index_select(sums[0], 2, slots, out=from_buffer(send[j], layout))
            del sums[0]
            mine = Sum(from_buffer(send[self.index], layout), len(own))
            for rows, grad in own:
                mine.add(rows, grad)
            mine.finish()
            del own, mine
            summed = from_buffer(self.schedule.comm.reduce_scatter(send), layout)
            del send
            target.copy_(summed)
            del summed

    def start_scatter(self, g, sums) -> InFlight:
        """Packed: start sending every other rank the ``sums`` of its tokens; ``finish()``
        gives, per tensor, the sum of what came."""
        p, me = self.size, self.index
        tokens = sums[0].shape[2] // p
        item = (sums[0].shape[1], sums[0].shape[3], sums[0].dtype)
        parts = [[rows[j * tokens:(j + 1) * tokens] for j in range(p)]
                 for rows in map(as_packed, sums)]
        pending, offsets = self._to_slots(parts, item, tokens, self.gathers, sums[0].device)
        others = [j for j in range(p) if j != me]

        def place(flat):
            accs = []
            for at in offsets:
                received = rows_at(flat, at, p * tokens, item).view(p, tokens, *item[:2])
                acc = received[others[0]] if others else received[me].zero_()
                for j in others[1:]:  # the region is this rank's until its next exchange
                    acc.add_(received[j])
                accs.append(acc)
            return accs

        return InFlight(pending, place)

    def land(self, g, in_flight: InFlight, mine) -> None:
        """Wait for a group's dK/dV sums, add this rank's own parts ``mine``, write them."""
        for acc, parts, target in zip(in_flight.finish(), mine, self._targets(g)):
            # sums in the target's dtype take a last gradient of every row on the way: one pass
            fused = bool(parts) and parts[-1][0] is None and acc.dtype == target.dtype
            for rows, grad in parts[:-1] if fused else parts:
                add_rows(as_block(acc), rows, grad)
            if fused:
                torch.add(acc, as_packed(parts[-1][1]), out=as_packed(target))
            else:
                as_packed(target).copy_(acc)
