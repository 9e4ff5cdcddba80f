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
"""

from __future__ import annotations

import torch

from sdpa_fusion.layout import Layout
from sdpa_fusion.merge import finish

from .base import Description
from .buffers import views
from .sequence import SequenceSchedule


class Ulysses(SequenceSchedule):
    name = "ulysses"

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

    def _to_heads(self, tensors, layout: Layout) -> list[torch.Tensor]:
        """Sequence-sharded [B, h, S/P, E] -> this rank's heads [B, h/P, S, E], global order."""
        shapes = [(b, self._heads_per_rank(h), s, e)
                  for b, h, s, e in (t.shape for t in tensors)]

        def fill(j, blocks):
            for t, block in zip(tensors, blocks):
                block.copy_(t.narrow(1, self._first_head(j, t.shape[1]), block.shape[1]))

        received = self._all_to_all(fill, shapes, layout, tensors[0])
        outs = []
        for i, (b, h, s, e) in enumerate(shapes):
            out = layout.empty((b, h, s * self.size, e), dtype=tensors[i].dtype,
                               device=tensors[i].device)
            for blocks, slots in zip(received, self.positions(s * self.size, out.device)):
                out.index_copy_(2, slots, blocks[i])
            outs.append(out)
        return outs

    def _to_sequence(self, tensors, layout: Layout, heads) -> list[torch.Tensor]:
        """This rank's heads [B, h/P, S, E] in global order -> its tokens of all ``heads``
        [B, h, S/P, E]; replicated K/V heads are summed."""
        shapes = [(b, h, s // self.size, e) for b, h, s, e in (t.shape for t in tensors)]
        positions = [self.positions(t.shape[2], t.device) for t in tensors]

        def fill(j, blocks):
            for t, where, block in zip(tensors, positions, blocks):
                torch.index_select(t, 2, where[j], out=block)

        received = self._all_to_all(fill, shapes, layout, tensors[0])
        return [self._place_heads([blocks[i] for blocks in received], h, layout)
                for i, h in enumerate(heads)]

    def _place_heads(self, blocks, heads: int, layout: Layout) -> torch.Tensor:
        """[B, heads, S/P, E] from the head blocks of every rank, in rank order."""
        b, width, s, e = blocks[0].shape
        replicated = heads < self.size
        dtype = torch.float32 if replicated else blocks[0].dtype
        out = layout.empty((b, heads, s, e), dtype=dtype, device=blocks[0].device)
        if replicated:
            out.zero_()
        for j, block in enumerate(blocks):
            target = out.narrow(1, self._first_head(j, heads), width)
            if replicated:
                target.add_(block)
            else:
                target.copy_(block)
        return finish(out, blocks[0].dtype, layout) if replicated else out

    def forward(self, q, k, v, spec, kernel, dropout=None):
        layout = spec.layout
        q_h, k_h, v_h = self._to_heads([q, k, v], layout)
        out_h, lse_h = kernel.forward(q_h, k_h, v_h, causal=spec.causal, scale=spec.softmax_scale)
        (out,) = self._to_sequence([out_h], layout, [spec.heads])
        (lse,) = self._to_sequence([lse_h.unsqueeze(-1)], Layout.BHSE, [spec.heads])
        return out, lse.squeeze(-1)

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        layout = spec.layout
        dout_h, q_h, k_h, v_h, out_h = self._to_heads([dout, q, k, v, out], layout)
        (lse_h,) = self._to_heads([lse.unsqueeze(-1)], Layout.BHSE)
        grads = kernel.backward(dout_h, q_h, k_h, v_h, out_h, lse_h.squeeze(-1),
                                causal=spec.causal, scale=spec.softmax_scale)
        heads = [spec.heads, spec.kv_heads, spec.kv_heads]
        return tuple(self._to_sequence(list(grads), layout, heads))

    def describe(self, spec):
        p = self.size
        q_head = spec.batch * (spec.q_len // p) * spec.head_dim * spec.dtype.itemsize
        kv_head = spec.batch * (spec.kv_len // p) * spec.head_dim * spec.dtype.itemsize
        h, h_kv = spec.heads // p, self._heads_per_rank(spec.kv_heads)
        lse = spec.batch * h * (spec.q_len // p) * 4
        forward = (p - 1) * (2 * h * q_head + 2 * h_kv * kv_head + lse)  # q, k, v; out, lse
        backward = (p - 1) * (3 * h * q_head + 2 * h_kv * kv_head + lse  # dout, q, k, v, out, lse
                              + h * q_head + 2 * h_kv * kv_head)         # dq, dk, dv
        flops = spec.flops() / p
        return Description(
            self.name, p, steps=1, bytes_sent=forward, bytes_received=forward, flops=flops,
            backward_steps=1, backward_bytes_sent=backward, backward_bytes_received=backward,
            backward_flops=spec.flops(backward=True) / p - flops,
            notes=f"partition {self.partition.name}; {h} of {spec.heads} heads and {h_kv} K/V "
                  f"heads per rank over the whole sequence; all-to-alls repeated in backward",
        )
