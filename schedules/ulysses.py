"""``ulysses``: context parallelism by trading the sequence split for a head split
(DeepSpeed-Ulysses, TE ``a2a``).

Rank r holds the tokens ``partition.indices(S, P, r)`` of q, k, v, all heads. One
all-to-all gives every rank all S tokens of H/P heads, placed in global token order; the
local kernel attends them (causal as asked) and a second all-to-all returns each rank its
own tokens of every head:

    rank r: [B, H, S/P, E]  --all-to-all-->  [B, H/P, S, E]  --kernel-->  out [B, H/P, S, E]
            out [B, H, S/P, E]  <--all-to-all--  (tokens back in partition order)

P = 2, H = 4, S = 8, contiguous:   before: rank 0 tokens 0-3, rank 1 tokens 4-7 (heads 0-3)
                                   after:  rank 0 heads 0-1, rank 1 heads 2-3 (tokens 0-7)

K/V heads are split alike; with fewer K/V heads than ranks (P % kv_heads == 0) each K/V head
goes to the P / kv_heads ranks whose query heads use it, and their dK/dV are summed back.
Backward sends dout, q, k, v, out and lse the same way and returns dq, dk, dv. With
``keep_forward=True`` the forward keeps the q, k, v that arrived and the out and lse it
attended (as TransformerEngine's a2a does) and backward sends only dout: a third fewer bytes
and gathers per step. What is kept stands in for the local q, k, v and out, which
``attention`` then no longer holds (a packed rank's whole documents' excepted): the memory
held from forward to backward grows by out's heads alone. Any
partition, causal mask and sliding window works: the tokens are attended in global order.

Packed sequences: each rank's real tokens go to their place among the real tokens of the
whole batch (no padding), attended by one varlen call; padding rows come back as zeros. Only
real tokens travel (``Routes``): per tensor, one gather of this rank's real rows into a send
buffer, the exchange, one gather into packed order (and back alike, but where every rank's
rows are already in packed order the results are sent as they are), not blocks placed row by
row (at 269K tokens on 2 H200 those copies took 45 ms of 257). Head groups run as a pipeline:

    start heads(0)
    for g:  finish heads(g) | start heads(g+1) | attend g | finish sequence(g-1) | start sequence(g)

The exchanges go through ``transport`` (``schedules.transport``): on GPUs of one host the copy
engines move them beside the attention kernel, which holds every SM; ``head_groups="auto"``
then takes ``heads.PIPELINE_GROUPS`` groups where the heads allow.

Partition ``documents`` (packed batches, ``schedules.whole``): each rank attends its whole
documents alone, all heads, and nothing of them travels; the documents cut over a group of
ranks run this schedule over the group, so only their tokens travel, and each rank of the
group attends all their tokens of heads/group. A cut packing is split into contiguous runs of
its documents one after another (``partition.Concatenated``): the heads' work is the same
whatever the split, and every rank's tokens are then in the order they are attended.

All of the above is a plan (``Ulysses.plan``: the ops of ``schedules.runner``; the exchanges
are its ``_Exchanges``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from sdpa_fusion.layout import Layout

from . import dry_run, heads, mask_plans, runner
from .assign import ULYSSES, ULYSSES_KEPT
from .buffers import views
from .calls import DenseCall, as_block, as_packed, packed_call, put_rows, take
from .partition import Auto, Concatenated
from .sequence import SequenceSchedule
from .transport import InFlight, Put, Take, Transported, rows_at, sections
from .whole import whole_documents


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every rank's tokens go in the whole sequence: ``parts[j]`` = (rows of rank j's
    ``local`` rows that travel, None for all; their rows among the ``length``); ``in_order``:
    rank 0's rows travel to the first rows, rank 1's to the next, ... in their local order."""

    length: int
    local: int
    parts: list
    in_order: bool = False


@dataclasses.dataclass(frozen=True)
class Routes:
    """How the real tokens of a packed batch travel, for this rank: it sends its real local
    ``rows`` to every rank; rank j sends ``counts[j]`` rows; ``order[t]``: the received row
    of packed slot t; ``back``: the packed slots of every rank's rows, rank by rank (all of
    them in order where ``in_order``); ``local[i]``: local row i's place among ``rows`` (0 for
    ``padding`` rows)."""

    rows: torch.Tensor
    counts: list
    order: torch.Tensor
    back: torch.Tensor
    local: torch.Tensor
    padding: torch.Tensor
    in_order: bool

    @property
    def starts(self) -> list[int]:
        """The first packed row of every rank's rows, in rank order."""
        return [sum(self.counts[:j]) for j in range(len(self.counts))]

    @property
    def total(self) -> int:
        """Real tokens of the packed batch."""
        return sum(self.counts)

    @classmethod
    def of(cls, place: Placement, rank: int) -> "Routes":
        rows = place.parts[rank][0]
        counts = [len(slots) for _, slots in place.parts]
        back = torch.cat([slots for _, slots in place.parts])
        order = torch.empty(place.length, dtype=torch.long, device=rows.device)
        order[back] = torch.arange(len(back), device=rows.device)
        local = torch.zeros(place.local, dtype=torch.long, device=rows.device)
        local[rows] = torch.arange(len(rows), device=rows.device)
        real = torch.zeros(place.local, dtype=torch.bool, device=rows.device)
        real[rows] = True
        return cls(rows, counts, order, back, local, (~real).nonzero().flatten(), place.in_order)

    def send_rows(self, stride: int) -> torch.Tensor:
        """Rank by rank, the rows of this rank's real tokens in a [T, H, E] tensor seen as rows
        of one rank's heads, ``stride`` rows a token (row i * stride + j: token i's heads of
        rank j): one gather fills a send buffer (made once per stride)."""
        kept = self.__dict__.setdefault("_send_rows", {})
        if stride not in kept:
            ranks = torch.arange(len(self.counts), device=self.rows.device)
            kept[stride] = (self.rows[None, :] * stride + ranks[:, None]).flatten()
        return kept[stride]

    @functools.cached_property
    def place_rows(self) -> torch.Tensor:
        """Per local row i and rank j (row i * P + j), its row among every rank's returned
        rows [P * n, H / P * E] (padding rows: rank j's first, filled afterwards)."""
        p, n = len(self.counts), len(self.rows)
        ranks = torch.arange(p, device=self.rows.device)
        return (ranks[None, :] * n + self.local[:, None]).flatten()


def packed_placement(split) -> Placement:
    """The real tokens of every rank at their places among the packed batch's real tokens."""
    starts = torch.cumsum(split.lengths, 0) - split.lengths
    parts, back = [], []
    for j in range(split.parts):
        rows = split.real[j].nonzero().flatten()
        slots = starts[split.sequence(j)[rows]] + split.positions[j][rows]
        parts.append((rows.to(split.device), slots.to(split.device)))
        back.append(slots)
    back = torch.cat(back)
    return Placement(int(split.lengths.sum()), split.tokens, parts,
                     torch.equal(back, torch.arange(len(back))))


@whole_documents
class Ulysses(Transported, SequenceSchedule):
    """All-to-all context parallelism; packed tokens travel by ``transport``."""

    name = "ulysses"
    needs_ordered_tokens = False  # attends the whole sequence in global order
    routes_packed = True  # packed real tokens travel by their ``Routes``
    # every rank's tokens of a cut packing in the order they are attended: results go home
    # with no gather (``Routes.in_order``); the work is the heads', whatever the split
    cut_partition = Concatenated()

    def __init__(self, mesh, *, dim=None, partition="load_balanced", transport="auto",
                 head_groups="auto", keep_forward=False):
        super().__init__(mesh, dim=dim, partition=partition, head_groups=head_groups)
        if not isinstance(keep_forward, bool):
            raise ValueError(f"keep_forward={keep_forward!r} must be True (backward reuses the "
                             f"heads its forward gathered) or False (backward gathers them again)")
        self.keep_forward = keep_forward
        if isinstance(self.partition, Auto):
            raise ValueError(
                "partition='auto' (the cost model's choice between 'documents' and "
                "'load_balanced') is made for schedules 'ring', 'allgather' and 'hybrid', not "
                "'ulysses'; name partition='load_balanced' (the default: every token travels) "
                "or 'documents' (whole documents stay on their rank, each cut one is split by "
                "heads over its group of ranks)"
            )
        self.use_transport(transport)

    @property
    def keeps_forward(self) -> bool:
        return self.keep_forward

    @property
    def exchange(self):
        """A rank's all-to-alls carry its share of each cut document (``schedules.assign``)."""
        return ULYSSES_KEPT if self.keep_forward else ULYSSES

    def backward_reads_inputs(self, spec) -> bool:
        return not self.keep_forward  # else the kept heads are all it reads (and dout)

    def packed_rows(self, split) -> int:
        """A group's call attends every sequence whole with 1/P of the heads: as many query
        rows per rank as the longest sequence's tokens / P (whatever the split)."""
        longest = int(split.lengths.max()) if len(split.lengths) else 0
        return -(-longest // self.size)

    def least_groups(self, spec) -> int:
        overlaps = spec.layout.is_varlen and self.routes_packed and self.keeps_buffers()
        return heads.PIPELINE_GROUPS if overlaps else 1

    def validate(self, spec):
        super().validate(spec)
        p = self.size
        if spec.heads % p:
            raise ValueError(
                f"heads={spec.heads} must be divisible by the {p} ranks of schedule 'ulysses' "
                f"(each rank attends heads/{p} heads over the whole sequence); use a multiple "
                f"of {p} heads, or schedule 'ring' or 'allgather'"
            )
        if spec.kv_heads % p and p % spec.kv_heads:
            raise ValueError(
                f"kv_heads={spec.kv_heads} must be divisible by the {p} ranks of schedule "
                f"'ulysses', or divide {p} (K/V heads are then replicated); use kv_heads among "
                f"the multiples or divisors of {p} that divide heads={spec.heads}"
            )

    def _heads_per_rank(self, heads: int) -> int:
        return max(heads // self.size, 1)

    def _first_head(self, rank: int, heads: int) -> int:
        """The first of ``heads`` heads that ``rank`` attends (replicas share it)."""
        return rank * heads // self.size

    def _call(self, spec):
        """The kernel call over the whole sequence of this rank's heads (None: no token)."""
        if spec.mask is not None:
            lengths = None if spec.packing is None else spec.packing.split.lengths
            return mask_plans.whole_call(spec, self.size, lengths)
        if spec.packing is not None:
            return self._packed_plan(spec)[1]
        return DenseCall(slice(None), slice(None), spec.causal, spec.window)

    def _packed_plan(self, spec):
        packing = spec.packing

        def build():
            place, lengths = packed_placement(packing.split), packing.split.lengths
            every = torch.arange(place.length)
            return place, packed_call(every, lengths, every, lengths, causal=spec.causal,
                                      tokens=(place.length, place.length), device=packing.device,
                                      window=spec.window)

        return packing.cached(("ulysses", spec.causal, spec.window), build)

    def _routes(self, spec, layout: Layout) -> Routes | None:
        """The routes of packed [T, H, E] tensors (None: dense, or ``routes_packed`` off)."""
        if spec.packing is None or layout is not Layout.BSHE or not self.routes_packed:
            return None
        return spec.packing.cached(("ulysses-routes", self.index),
                                   lambda: Routes.of(self._packed_plan(spec)[0], self.index))

    def groups_fit(self, groups, heads_q, kv_heads):
        kv, p = kv_heads // groups, self.size
        return (heads_q // groups) % p == 0 and (kv % p == 0 or p % kv == 0)

    def check_groups(self, groups, spec):
        if not self.groups_fit(groups, spec.heads, spec.kv_heads):
            heads_q, kv = spec.heads // groups, spec.kv_heads // groups
            raise ValueError(
                f"head_groups={groups} leaves {heads_q} query and {kv} K/V heads per group; "
                f"schedule 'ulysses' over {self.size} ranks needs query heads per group "
                f"divisible by {self.size} and K/V heads per group divisible by or dividing "
                f"{self.size}; use 'auto' or fewer groups"
            )

    # ---- the plan ------------------------------------------------------------------------
    def plan(self, spec, q, k, *, backward: bool) -> runner.Plan:
        """This rank's ``runner.Plan`` of a forward (or ``backward``) on the local ``spec``."""
        layout = Layout.BSHE if spec.packing is not None else spec.layout
        routes, groups = self._routes(spec, layout), len(self.groups_of(q, k, spec))
        call = self._call(spec)
        ops = [runner.Gather(0)] if routes is not None else []
        for g in range(groups):
            attend = runner.Attend(call, ("ulysses", self.index, g))
            if routes is None:
                ops += [runner.Gather(g), runner.KV(g, arrives=True), attend, runner.Drop(),
                        runner.Scatter(g)]
                continue
            ops.append(runner.KV(g, arrives=True))
            if g + 1 < groups:
                ops.append(runner.Gather(g + 1))
            ops += [attend, runner.Drop()]
            if g:
                ops.append(runner.Land(g - 1))
            ops.append(runner.StartScatter(g))
        if routes is not None:
            ops.append(runner.Land(groups - 1))
        return runner.Plan(tuple(ops), groups, transfers=_Exchanges(self, spec, layout, routes))

    def describe(self, spec):
        """What a dry run of this rank's plans does for the global ``spec``."""
        d = dry_run.describe(self, spec)
        groups = self.groups_for(spec)
        h_kv = groups * self._heads_per_rank(spec.kv_heads // groups)
        return dataclasses.replace(d, notes=(
            f"partition {self.partition.name}; {spec.heads // self.size} of {spec.heads} heads "
            f"and {h_kv} K/V heads per rank over the whole sequence; "
            + ("q, k, v, out and lse kept from forward, backward sends dout; "
               if self.keep_forward else "all-to-alls repeated in backward; ")
            + f"{groups} head group(s)"
            + (f"; packed through transport {self.transport}" if spec.layout.is_varlen else "")
            + f"; {d.notes}"))


class _Exchanges:
    """How one call's heads travel (``runner.Plan.transfers``)."""

    def __init__(self, schedule: Ulysses, spec, layout: Layout, routes: Routes | None):
        self.schedule, self.spec, self.layout, self.routes = schedule, spec, layout, routes
        self.size, self.index = schedule.size, schedule.index
        self.first_head, self.heads_per_rank = schedule._first_head, schedule._heads_per_rank

    def placement(self, s_local: int, device) -> Placement:
        """Where every rank's ``s_local`` tokens go in the whole sequence."""
        if self.spec.packing is not None:
            return self.schedule._packed_plan(self.spec)[0]
        length = s_local * self.size
        positions = self.schedule.positions(length, device)
        return Placement(length, s_local, [(None, t) for t in positions])

    def begin(self, tensors, groups, backward: bool, kept=None) -> None:
        """Before the call's first op. ``kept`` (``Ulysses.keep_forward``): a forward leaves
        there each head group's arrived q, k, v and its out and lse; a backward that finds
        every group's there sends only dout to the heads' owners."""
        t = tensors
        lse = t["lse"].unsqueeze(-1)
        self.backward, self.kept = backward, kept
        self.reuse = backward and kept is not None and \
            all(len(kept.get(g.index, ())) == 5 for g in groups)
        if backward:
            self.inputs = (lambda g: [g.of_q(t["dout"])]) if self.reuse else (
                lambda g: [g.of_q(t["dout"]), g.of_q(t["q"]), g.of_kv(t["k"]), g.of_kv(t["v"]),
                           g.of_q(t["out"]), g.of_q(lse)])
            self.outputs = lambda g: [g.of_q(t["dq"]), g.of_kv(t["dk"]), g.of_kv(t["dv"])]
            self.fills = (0.0, 0.0, 0.0)
        else:
            self.inputs = lambda g: [g.of_q(t["q"]), g.of_kv(t["k"]), g.of_kv(t["v"])]
            self.outputs = lambda g: [g.of_q(t["out"]), g.of_q(lse)]
            self.fills = (0.0, float("-inf"))
        if self.routes is None:
            return
        first, targets = self.inputs(groups[0]), self.outputs(groups[0])
        self.routed = [target.shape[1] >= self.size for target in targets]
        self.heads_bytes = self._heads_region(first)[2]
        sequence_bytes = self._sequence_region(
            [(target.shape[1] // self.size, target.shape[3], target.dtype)
             for target, r in zip(targets, self.routed) if r])[1]
        device = first[0].device
        self.schedule.mover(device).reserve(self.heads_bytes + sequence_bytes, device)

    def gather(self, g):
        """Start sending group ``g``'s heads to their owners; ``wait()`` gives this rank's."""
        inputs = self.inputs(g)
        if self.routes is not None:
            return runner.Arriving(self._kept_with(g, self._start_heads(inputs, 0).finish))
        lse = inputs[5:]  # backward: lse travels in its own layout
        arrived = self._to_heads(inputs[:5], self.layout)
        if lse:
            arrived += self._to_heads(lse, Layout.BHSE)
        return runner.Arriving(self._kept_with(g, lambda: arrived))

    def _kept_with(self, g, finish):
        """``finish`` (what arrives for group ``g``) keeping a forward's arrivals in ``kept``,
        or a backward's (dout) followed by what its forward kept."""
        if self.kept is None or (self.backward and not self.reuse):
            return finish
        if self.reuse:
            return lambda: [*finish(), *self.kept[g.index]]

        def keep():
            self.kept[g.index] = arrived = list(finish())
            return list(arrived)

        return keep

    def _keep_results(self, g, results) -> None:
        """A forward keeping (``kept``): group ``g``'s out and lse after its q, k, v."""
        if self.kept is not None and not self.backward:
            self.kept[g.index] += results

    def scatter(self, g, parts, results) -> None:
        """Dense: this rank's heads of every token back home, into group ``g``'s outputs."""
        targets = self.outputs(g)
        if len(targets) == 2:  # forward: out, then lse
            self._keep_results(g, results)
            out, lse = results
            results.clear()
            self._blocks_to_sequence([out], targets[:1], self.layout, 0.0)
            self._blocks_to_sequence([lse], targets[1:], Layout.BHSE, float("-inf"))
            return
        self._blocks_to_sequence(results, targets, self.layout, 0.0)

    def start_scatter(self, g, results):
        """Packed: start sending the results home (replicated K/V heads' summed first)."""
        self._keep_results(g, results)
        targets = self.outputs(g)
        summed = [(t, target) for t, target, r in zip(results, targets, self.routed) if not r]
        if summed:
            self._blocks_to_sequence(*zip(*summed), Layout.BSHE, 0.0)
        sent = [(t, target, fill) for t, target, fill, r in
                zip(results, targets, self.fills, self.routed) if r]
        results.clear()
        del summed
        return self._start_sequence(*zip(*sent), self.heads_bytes)

    def land(self, g, in_flight, parts) -> None:
        in_flight.finish()

    # ---- dense: all-to-alls of blocks of every local row ---------------------------------------
    def _all_to_all(self, fill, shapes, layout: Layout, like: torch.Tensor):
        """One all-to-all of ``shapes``: ``fill(j, blocks)`` writes rank j's; each rank's blocks."""
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        send = torch.empty((self.size, numel), dtype=like.dtype, device=like.device)
        for j in range(self.size):
            fill(j, views(send[j], shapes, layout))
        received = self.schedule.comm.all_to_all(send)
        return [views(part, shapes, layout) for part in received]

    def _to_heads(self, tensors, layout: Layout) -> list[torch.Tensor]:
        """Sequence-sharded [B, h, S/P, E] -> this rank's heads [B, h/P, S, E], global order."""
        shapes = [(b, self.heads_per_rank(h), s, e)
                  for b, h, s, e in (t.shape for t in tensors)]

        def fill(j, blocks):
            for t, block in zip(tensors, blocks):
                block.copy_(t.narrow(1, self.first_head(j, t.shape[1]), block.shape[1]))

        received = self._all_to_all(fill, shapes, layout, tensors[0])
        outs = []
        for i, (b, h, s, e) in enumerate(shapes):
            place = self.placement(s, tensors[i].device)
            out = layout.empty((b, h, place.length, e), dtype=tensors[i].dtype,
                               device=tensors[i].device)
            if sum(len(slots) for _, slots in place.parts) != place.length:
                out.zero_()  # rows no rank fills
            for blocks, (rows, slots) in zip(received, place.parts):
                out.index_copy_(2, slots, take(blocks[i], rows))
            outs.append(out)
        return outs

    def _blocks_to_sequence(self, tensors, targets, layout: Layout, padding: float) -> None:
        """This rank's heads [B, h/P, S, E] -> its tokens of all heads in ``targets``
        [B, h, S/P, E] (replicated heads summed, rows that did not travel ``padding``)."""
        places = [self.placement(t.shape[2] // self.size, t.device) for t in tensors]
        shapes = [(t.shape[0], t.shape[1], place.local, t.shape[3])
                  for t, place in zip(tensors, places)]

        def fill(j, blocks):
            for t, place, block in zip(tensors, places, blocks):
                rows, slots = place.parts[j]
                if rows is None:
                    torch.index_select(t, 2, slots, out=block)
                else:
                    block.fill_(padding)
                    put_rows(block, rows, take(t, slots))

        received = self._all_to_all(fill, shapes, layout, tensors[0])
        for i, target in enumerate(targets):
            self._place_heads([blocks[i] for blocks in received], target)

    def _place_heads(self, blocks, target: torch.Tensor) -> None:
        """``target`` [B, heads, S/P, E] from the head blocks of every rank, in rank order."""
        heads, width = target.shape[1], blocks[0].shape[1]
        replicated = heads < self.size
        acc = torch.zeros(target.shape, dtype=torch.float32, device=target.device) \
            if replicated else target
        for j, block in enumerate(blocks):
            part = acc.narrow(1, self.first_head(j, heads), width)
            if replicated:
                part.add_(block)
            else:
                part.copy_(block)
        if replicated:
            target.copy_(acc)

    # ---- packed: the real tokens by their routes, through the transport ----------------------
    def _start_heads(self, tensors, base: int) -> InFlight:
        """Start sending this rank's real tokens to the owners of their heads (by routes)."""
        routes = self.routes
        n, p, me, starts = len(routes.rows), self.size, self.index, routes.starts
        items, offsets, nbytes = self._heads_region(tensors)
        mover = self.schedule.mover(tensors[0].device)
        region = mover.region(base, nbytes, tensors[0].device)
        puts, takes = [], []
        for t, (width, e, _), at in zip(tensors, items, offsets):
            row = width * e * t.element_size()
            send = t.new_empty((p * n, width, e))
            self._fill_send(as_packed(t), send)
            for j in range(p):
                part = send[j * n:(j + 1) * n]
                puts.append(Put(part, (j - me) % p, at + starts[me] * row))
                takes.append(Take((me - j) % p, at + starts[j] * row, routes.counts[j] * row))
        pending = mover.exchange(puts, takes, region)
        del puts, send, part

        def place(flat):
            return [as_block(torch.index_select(rows_at(flat, at, routes.total, item), 0,
                                                routes.order))
                    for item, at in zip(items, offsets)]

        return InFlight(pending, place)

    def _fill_send(self, packed: torch.Tensor, send: torch.Tensor) -> None:
        """``send`` [P * n, width, E]: this rank's real rows of ``packed`` [T, H, E], the heads
        of rank 0, then of rank 1, ...: one gather where each token's heads are rows of
        ``width`` heads side by side in memory (a head group of a dense tensor too: the rows
        of the tensor it is part of, ``Routes.send_rows``), else one per rank."""
        routes, p, width = self.routes, self.size, send.shape[1]
        row = width * send.shape[2]
        t, h, e = packed.shape
        if (h == p * width and t and packed.stride(2) == 1 and packed.stride(1) == e
                and packed.stride(0) % row == 0):
            stride = packed.stride(0) // row
            rows = packed.as_strided(((t - 1) * stride + p, row), (row, 1))
            torch.index_select(rows, 0, routes.send_rows(stride), out=send.view(len(send), row))
            return
        n = len(routes.rows)
        for j in range(p):
            torch.index_select(packed.narrow(1, self.first_head(j, packed.shape[1]), width), 0,
                               routes.rows, out=send[j * n:(j + 1) * n])

    def _start_sequence(self, tensors, targets, fills, base: int) -> InFlight:
        """Start sending this rank's heads of every real token home, into ``targets``."""
        routes = self.routes
        n, p, me, starts, counts = len(routes.rows), self.size, self.index, routes.starts, \
            routes.counts
        items = [(t.shape[1], t.shape[3], t.dtype) for t in tensors]
        offsets, nbytes = self._sequence_region(items)
        mover = self.schedule.mover(tensors[0].device)
        region = mover.region(base, nbytes, tensors[0].device)
        puts, takes = [], []
        for t, (width, e, _), at in zip(tensors, items, offsets):
            row = width * e * t.element_size()
            send = as_packed(t)
            if not (routes.in_order and send.is_contiguous()):
                send = torch.index_select(send, 0, routes.back)
            for j in range(p):
                puts.append(Put(send[starts[j]:starts[j] + counts[j]], (j - me) % p,
                                at + me * counts[j] * row))
                takes.append(Take((me - j) % p, at + j * n * row, n * row))
        pending = mover.exchange(puts, takes, region)
        del puts, send

        def place(flat):
            for target, fill, item, at in zip(targets, fills, items, offsets):
                self._place_rows(rows_at(flat, at, p * n, item).view(p, n, *item[:2]), target,
                                 fill)

        return InFlight(pending, place)

    def _place_rows(self, received, target, fill: float) -> None:
        """``target`` from every rank's rows [P, n, h, E] of this rank's real tokens: one
        gather straight into its heads where ``target`` is dense (``Routes.place_rows``; the
        GPU's vectorized gather, no temporary), else one per rank."""
        p, n, width, e = received.shape
        routes = self.routes
        dest = as_packed(target)
        if n == 0:  # every local row is padding
            dest.fill_(fill)
            return
        if dest.is_contiguous() and dest.shape[1] == p * width:
            torch.index_select(received.view(p * n, width * e), 0, routes.place_rows,
                               out=dest.view(len(dest) * p, width * e))
        else:
            for j in range(p):
                torch.index_select(received[j], 0, routes.local,
                                   out=dest.narrow(1, j * width, width))
        if len(routes.padding):
            dest.index_fill_(0, routes.padding, fill)

    def _heads_region(self, tensors):
        """(items, section offsets, bytes) of the region receiving this rank's heads."""
        items = [(self.heads_per_rank(t.shape[1]), t.shape[3], t.dtype) for t in tensors]
        return (items, *sections(items, self.routes.total))

    def _sequence_region(self, items) -> tuple[list[int], int]:
        """(section offsets, bytes) of the region receiving this rank's tokens (alike on all
        ranks: as many rows per rank as the rank with the most)."""
        return sections(items, self.size * max(self.routes.counts))

