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
Backward repeats the first all-to-all for dout, q, k, v and out (and lse), runs the local
backward and returns dq, dk, dv the same way. Nothing is kept between forward and backward.

Any partition works, causal and sliding windows included: the tokens are attended in global
order, the window over the whole sequence (per sequence when packed). Packed
sequences: each rank's real tokens go to their place among the real tokens of the whole
packed batch (no padding), attended by one varlen call; padding rows come back as zeros.
Only real tokens travel (``Routes``): per tensor, one gather of this rank's real rows into
the send buffer, an all-to-all of every rank's own count, one gather into packed order (and
the same way back), instead of whole blocks placed row by row (at 269K tokens on 2 H200 the
step's index copies and block copies took 45 ms of 257).
"""

from __future__ import annotations

import dataclasses

import torch

from sdpa_fusion.layout import Layout

from .base import Description
from .buffers import views
from .calls import DenseCall, as_block, as_packed, packed_call, put_rows, take
from .memory import Memory, Sizes, kernel_call
from .sequence import SequenceSchedule


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every rank's tokens go in the whole sequence the heads are attended over:
    ``parts[j]`` = (rows of rank j's ``local`` rows that travel, None for all; their rows
    among the ``length`` rows of the whole sequence)."""

    length: int
    local: int
    parts: list

    @property
    def complete(self) -> bool:
        """Whether the parts fill every row of the whole sequence (else the rest is zeros)."""
        return sum(len(slots) for _, slots in self.parts) == self.length


@dataclasses.dataclass(frozen=True)
class Routes:
    """How the real tokens of a packed batch travel (every packed slot one rank's real
    token, as ``packed_placement`` places them), for this rank: it sends its real local
    ``rows`` to every rank; rank j sends ``counts[j]`` rows; ``order[t]``: the received row
    (rank by rank) of packed slot t; ``back``: the packed slots of every rank's rows, rank by
    rank (what a head owner returns); ``local[i]``: local row i's place among ``rows`` (0
    for ``padding`` rows)."""

    rows: torch.Tensor
    counts: list
    order: torch.Tensor
    back: torch.Tensor
    local: torch.Tensor
    padding: torch.Tensor

    @classmethod
    def of(cls, place: Placement, rank: int) -> "Routes":
        rows = place.parts[rank][0]
        counts = [len(slots) for _, slots in place.parts]
        starts = [sum(counts[:j]) for j in range(len(counts))]
        order = torch.empty(place.length, dtype=torch.long, device=rows.device)
        for (_, slots), start in zip(place.parts, starts):
            order[slots] = torch.arange(start, start + len(slots), device=rows.device)
        local = torch.zeros(place.local, dtype=torch.long, device=rows.device)
        local[rows] = torch.arange(len(rows), device=rows.device)
        real = torch.zeros(place.local, dtype=torch.bool, device=rows.device)
        real[rows] = True
        return cls(rows, counts, order, torch.cat([slots for _, slots in place.parts]), local,
                   (~real).nonzero().flatten())


def packed_placement(split) -> Placement:
    """The real tokens of every rank, each at its place among the real tokens of the
    packed batch (sequence by sequence, in position order)."""
    starts = torch.cumsum(split.lengths, 0) - split.lengths
    parts = []
    for j in range(split.parts):
        rows = split.real[j].nonzero().flatten()
        slots = starts[split.seq[rows]] + split.positions[j][rows]
        parts.append((rows.to(split.device), slots.to(split.device)))
    return Placement(int(split.lengths.sum()), split.tokens, parts)


class Ulysses(SequenceSchedule):
    name = "ulysses"
    needs_ordered_tokens = False  # attends the whole sequence in global order
    routes_packed = True  # packed real tokens travel by their ``Routes``

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
        """The first of ``heads`` heads that ``rank`` attends (replicas share one when heads < P)."""
        return rank * heads // self.size

    def _all_to_all(self, fill, shapes, layout: Layout, like: torch.Tensor):
        """One all-to-all of several tensors. ``fill(j, blocks)`` writes what goes to rank j
        into logical ``blocks`` of ``shapes``; returns, for each rank j, the blocks from j."""
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        send = torch.empty((self.size, numel), dtype=like.dtype, device=like.device)
        for j in range(self.size):
            fill(j, views(send[j], shapes, layout))
        received = self.comm.all_to_all(send)
        return [views(part, shapes, layout) for part in received]

    def _placement(self, spec, s_local: int, device) -> Placement:
        """Where every rank's ``s_local`` tokens go in the whole sequence."""
        if spec.packing is not None:
            return self._packed_plan(spec)[0]
        length = s_local * self.size
        return Placement(length, s_local, [(None, t) for t in self.positions(length, device)])

    def _call(self, spec):
        """The kernel call over the whole sequence of this rank's heads (None: no token)."""
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

    @staticmethod
    def _buffers(like: torch.Tensor, width: int, send_rows: int, receive_rows: int):
        """views(w) -> (send, receive): [send_rows, w, E] and [receive_rows, w, E] views of one
        send and one receive buffer of ``width`` heads of ``like``'s dtype, which every tensor
        of an exchange reuses (what one tensor freed the next would take again while the
        collective may still hold it)."""
        e = like.shape[-1]
        send = like.new_empty(send_rows * width * e)
        receive = like.new_empty(receive_rows * width * e)

        def views(w: int):
            return (send[:send_rows * w * e].view(send_rows, w, e),
                    receive[:receive_rows * w * e].view(receive_rows, w, e))

        return views

    def _packed_to_heads(self, tensors, routes: Routes) -> list[torch.Tensor]:
        """This rank's real tokens of packed [1, H, S/P, E] tensors -> its heads of every real
        token [1, H/P, T, E] in packed order: per tensor one gather per rank into the send
        buffer, an all-to-all of every rank's real rows, one gather into packed order."""
        n, p = len(routes.rows), self.size
        widths = [self._heads_per_rank(t.shape[1]) for t in tensors]
        views = self._buffers(tensors[0], max(widths), p * n, sum(routes.counts))
        outs = []
        for t, width in zip(tensors, widths):
            rows = as_packed(t)
            send, receive = views(width)
            for j in range(p):
                torch.index_select(rows.narrow(1, self._first_head(j, t.shape[1]), width), 0,
                                   routes.rows, out=send[j * n:(j + 1) * n])
            received = self.comm.all_to_all_rows(send, [n] * p, routes.counts, out=receive)
            outs.append(as_block(torch.index_select(received, 0, routes.order)))
        return outs

    def _packed_to_sequence(self, tensors, targets, routes: Routes) -> None:
        """This rank's heads [1, h, T, E] of every real token -> its tokens of all heads in
        ``targets`` [1, P h, S/P, E] (padding rows zero): per tensor one gather of every
        rank's rows, an all-to-all, one gather into local order."""
        n, p = len(routes.rows), self.size
        views = self._buffers(tensors[0], max(t.shape[1] for t in tensors), sum(routes.counts),
                              p * n)
        for t, target in zip(tensors, targets):
            width, e = t.shape[1], t.shape[3]
            send, receive = views(width)
            torch.index_select(as_packed(t), 0, routes.back, out=send)
            received = self.comm.all_to_all_rows(send, routes.counts, [n] * p, out=receive)
            dest = as_packed(target)
            if n == 0:  # every local row is padding
                dest.zero_()
                continue
            by_row = received.view(p, n, width, e).transpose(0, 1)  # [n, P, h, E]
            if dest.is_contiguous():
                torch.index_select(by_row, 0, routes.local,
                                   out=dest.view(dest.shape[0], p, width, e))
            else:
                dest.copy_(torch.index_select(by_row, 0, routes.local).flatten(1, 2))
            if len(routes.padding):
                dest.index_fill_(0, routes.padding, 0)

    def _to_heads(self, tensors, layout: Layout, spec) -> list[torch.Tensor]:
        """Sequence-sharded [B, h, S/P, E] -> this rank's heads [B, h/P, S, E], global order."""
        routes = self._routes(spec, layout)
        if routes is not None:
            return self._packed_to_heads(tensors, routes)
        shapes = [(b, self._heads_per_rank(h), s, e)
                  for b, h, s, e in (t.shape for t in tensors)]

        def fill(j, blocks):
            for t, block in zip(tensors, blocks):
                block.copy_(t.narrow(1, self._first_head(j, t.shape[1]), block.shape[1]))

        received = self._all_to_all(fill, shapes, layout, tensors[0])
        outs = []
        for i, (b, h, s, e) in enumerate(shapes):
            place = self._placement(spec, s, tensors[i].device)
            out = layout.empty((b, h, place.length, e), dtype=tensors[i].dtype,
                               device=tensors[i].device)
            if not place.complete:
                out.zero_()
            for blocks, (rows, slots) in zip(received, place.parts):
                out.index_copy_(2, slots, take(blocks[i], rows))
            outs.append(out)
        return outs

    def _to_sequence(self, tensors, layout: Layout, targets, spec, padding: float = 0.0) -> None:
        """This rank's heads [B, h/P, S, E] in global order -> its tokens of all heads, written
        into ``targets`` [B, h, S/P, E]; replicated K/V heads are summed; rows that did not
        travel (padding) are ``padding``. Packed tensors of no replicated head take their
        routes; the rest travel together as blocks of every local row."""
        routes = self._routes(spec, layout) if padding == 0.0 else None
        routed, rest = [], []
        for t, target in zip(tensors, targets):
            fits = routes is not None and target.shape[1] == t.shape[1] * self.size
            (routed if fits else rest).append((t, target))
        if routed:
            self._packed_to_sequence(*zip(*routed), routes)
        if rest:
            self._blocks_to_sequence(*zip(*rest), layout, spec, padding)

    def _blocks_to_sequence(self, tensors, targets, layout: Layout, spec, padding: float) -> None:
        """``_to_sequence`` by one all-to-all of blocks of every local row."""
        places = [self._placement(spec, t.shape[2] // self.size, t.device) for t in tensors]
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
            part = acc.narrow(1, self._first_head(j, heads), width)
            if replicated:
                part.add_(block)
            else:
                part.copy_(block)
        if replicated:
            target.copy_(acc)

    def groups_fit(self, groups, heads_q, kv_heads):
        return (heads_q // groups) % self.size == 0 and self._kv_fit(kv_heads // groups)

    def check_groups(self, groups, spec):
        heads_q, kv = spec.heads // groups, spec.kv_heads // groups
        if heads_q % self.size or not self._kv_fit(kv):
            raise ValueError(
                f"head_groups={groups} leaves {heads_q} query and {kv} K/V heads per group; "
                f"schedule 'ulysses' over {self.size} ranks needs query heads per group "
                f"divisible by {self.size} and K/V heads per group divisible by or dividing "
                f"{self.size}; use 'auto' or fewer groups"
            )

    def _kv_fit(self, kv_heads: int) -> bool:
        return kv_heads % self.size == 0 or self.size % kv_heads == 0

    def _stream(self, dropout, group):
        """The dropout stream of this rank's heads of head group ``group`` over the whole
        sequence (None without dropout)."""
        return dropout.stream("ulysses", self.index, group.index) if dropout is not None else None

    def forward(self, q, k, v, spec, kernel, dropout=None):
        packed = spec.packing is not None
        layout = Layout.BSHE if packed else spec.layout
        if packed:
            q, k, v = (as_block(t) for t in (q, k, v))
        call = self._call(spec)
        out = layout.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for g in self.groups_of(q, k, spec):
            q_h, k_h, v_h = self._to_heads([g.of_q(q), g.of_kv(k), g.of_kv(v)], layout, spec)
            if call is None:  # no real token anywhere
                out_h = torch.zeros_like(q_h)
                lse_h = torch.full(q_h.shape[:3], float("-inf"), device=q.device)
            else:
                out_h, lse_h = call.forward(kernel, q_h, k_h, v_h, spec.softmax_scale,
                                            self._stream(dropout, g))
            del q_h, k_h, v_h
            self._to_sequence([out_h], layout, [g.of_q(out)], spec)
            self._to_sequence([lse_h.unsqueeze(-1)], Layout.BHSE, [g.of_q(lse).unsqueeze(-1)],
                              spec, padding=float("-inf"))
            del out_h, lse_h
        return (as_packed(out) if packed else out), lse

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        packed = spec.packing is not None
        layout = Layout.BSHE if packed else spec.layout
        if packed:
            dout, q, k, v, out = (as_block(t) for t in (dout, q, k, v, out))
        call = self._call(spec)
        dq, dk, dv = (layout.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        for g in self.groups_of(q, k, spec):
            inputs = self._to_heads([g.of_q(dout), g.of_q(q), g.of_kv(k), g.of_kv(v),
                                     g.of_q(out)], layout, spec)
            (lse_h,) = self._to_heads([g.of_q(lse).unsqueeze(-1)], Layout.BHSE, spec)
            if call is None:
                grads = [torch.zeros_like(t) for t in inputs[1:4]]
            else:
                grads = call.backward(kernel, *inputs, lse_h.squeeze(-1), spec.softmax_scale,
                                      self._stream(dropout, g))
            del inputs, lse_h
            self._to_sequence(list(grads), layout, [g.of_q(dq), g.of_kv(dk), g.of_kv(dv)], spec)
            del grads
        return tuple(as_packed(t) for t in (dq, dk, dv)) if packed else (dq, dk, dv)

    def _kv_per_rank(self, spec) -> tuple[int, bool]:
        """(K/V heads this rank attends over all head groups, whether they are replicated:
        a group with fewer K/V heads than ranks gives each rank a copy of one)."""
        groups = self.groups_for(spec)
        kv = spec.kv_heads // groups
        return groups * self._heads_per_rank(kv), kv < self.size

    def _packed_traffic(self, spec) -> tuple[int, int, int, int]:
        """Bytes (forward sent, received; backward sent, received) of a packed call: the
        real tokens of q, k, v, out, dout and the gradients by their routes; lse, and the
        gradients of replicated K/V heads, as blocks of every local row."""
        p, local, e = self.size, self.local_tokens(spec), spec.head_dim * spec.dtype.itemsize
        counts = self.split(spec.cu_seqlens, spec.cu_seqlens_padded, "cpu").real.sum(1).tolist()
        mine, others = counts[self.index], sum(counts) - counts[self.index]
        h, (h_kv, replicated) = spec.heads // p, self._kv_per_rank(spec)
        away, back = mine * (p - 1) * e, others * e  # per head: to every owner, from every rank
        lse = (p - 1) * h * local * 4
        if replicated:  # dK/dV summed from blocks
            kv_grads = (2 * h_kv * (p - 1) * local * e,) * 2
        else:
            kv_grads = (2 * h_kv * back, 2 * h_kv * away)
        return ((h + 2 * h_kv) * away + h * back + lse, (h + 2 * h_kv) * back + h * away + lse,
                (3 * h + 2 * h_kv) * away + lse + h * back + kv_grads[0],
                (3 * h + 2 * h_kv) * back + lse + h * away + kv_grads[1])

    def describe(self, spec):
        p, local = self.size, self.local_tokens(spec)
        q_head = spec.batch * (spec.q_len // p if not spec.layout.is_varlen else local) \
            * spec.head_dim * spec.dtype.itemsize
        kv_head = spec.batch * local * spec.head_dim * spec.dtype.itemsize
        h, (h_kv, _) = spec.heads // p, self._kv_per_rank(spec)
        lse = q_head // (spec.head_dim * spec.dtype.itemsize) * h * 4
        forward = (p - 1) * (2 * h * q_head + 2 * h_kv * kv_head + lse)  # q, k, v; out, lse
        backward = (p - 1) * (3 * h * q_head + 2 * h_kv * kv_head + lse  # dout, q, k, v, out, lse
                              + h * q_head + 2 * h_kv * kv_head)         # dq, dk, dv
        traffic = (forward, forward, backward, backward)
        if spec.layout.is_varlen and self.routes_packed:
            traffic = self._packed_traffic(spec)
        flops = spec.flops() / p
        return Description(
            self.name, p, steps=1, bytes_sent=traffic[0], bytes_received=traffic[1], flops=flops,
            backward_steps=1, backward_bytes_sent=traffic[2], backward_bytes_received=traffic[3],
            backward_flops=spec.flops(backward=True) / p - flops,
            notes=f"partition {self.partition.name}; {h} of {spec.heads} heads and {h_kv} K/V "
                  f"heads per rank over the whole sequence; all-to-alls repeated in backward; "
                  f"{self.groups_for(spec)} head group(s)",
            memory=self.memory(spec),
        )

    def memory(self, spec, call=None) -> Memory:
        """What this rank allocates for a call on the global ``spec``, per head group: the
        send and receive buffers of an all-to-all and what it places (the group's q, k, v in
        forward; dout, q, k, v, out in backward; packed, one tensor at a time through one
        send and one receive buffer), the kernel call's allocations, and the all-to-all of
        its results back into the outputs. ``call(heads, kv_heads)``: the ``Memory`` of the
        kernel call on that many query and K/V heads of the whole sequence when it is not a
        GPU kernel's (under ``hybrid``, the outer schedule's)."""
        rows = self.local_tokens(spec)
        groups = self.groups_for(spec)
        size, whole = Sizes(spec, rows, groups), Sizes(spec, rows)
        q = size.q()
        kv_local = self._heads_per_rank(spec.kv_heads // groups)
        kv = size.kv() * kv_local * self.size \
            // max(spec.kv_heads // groups, 1)  # K (or V) of a group as the ranks hold it
        replicated = size.kv(itemsize=4) if spec.kv_heads // groups < self.size else 0
        lse = size.lse()
        kernel = kernel_call(size, rows, kv) if call is None else \
            call(spec.heads // groups // self.size, kv_local)
        inputs, grads = 3 * q + 2 * kv, q + 2 * kv
        if spec.layout.is_varlen and self.routes_packed:  # one tensor at a time
            arrive, send_in = _exchange(q, kv, kv), _exchange(q, q, kv, kv, q)
            back = grads + 2 * (q if replicated else max(q, kv))
            if replicated:  # dK, dV as blocks, summed in fp32
                back = max(back, grads + 4 * kv + replicated)
        else:  # every tensor in one all-to-all
            arrive, send_in, back = 2 * (q + 2 * kv), 2 * inputs, 3 * grads + replicated
        forward = max(arrive, q + 2 * kv + kernel.outputs + kernel.forward,
                      2 * q + kernel.outputs)
        backward = whole.q() + 2 * whole.kv() + max(
            send_in, inputs + 2 * lse + kernel.backward, back)
        return Memory(outputs=whole.q() + whole.lse(), forward=forward, backward=backward,
                      kept=kernel.kept)


def _exchange(*sizes: int) -> int:
    """The peak of tensors of ``sizes`` bytes arriving one after another beside one send
    and one receive buffer of the largest: all of them and the two buffers."""
    return sum(sizes) + 2 * max(sizes)
