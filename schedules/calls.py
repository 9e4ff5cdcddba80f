"""Kernel calls on parts of K/V blocks: which query rows of this rank meet which key rows of
a block, and with what mask. The one vocabulary of the sequence schedules' plans.

A ``DenseCall`` takes row ranges of [B, H, S, E] tensors, a ``PackedCall`` rows of packed
tokens and the ``Seqlens`` of one varlen kernel call over every sequence. Packed [T, H, E]
tensors travel through the schedules as [1, H, T, E] views (``as_block``), so plans, merges
and transports are the same for dense and packed tensors.

A call's mask is data: ``causal`` and a top-left ``window`` in the call's own coordinates
(per sequence of a packed call; ``schedules.bands`` makes them for split sequences).
"""

from __future__ import annotations

import dataclasses

import torch

from sdpa_fusion.kernels.base import Seqlens, layout_of
from sdpa_fusion.mask import Window, call_pairs
from sdpa_fusion.merge import Merged, take_rows


def as_block(t: torch.Tensor) -> torch.Tensor:
    """A packed [T, H, E] tensor as the [1, H, T, E] view the schedules loop over."""
    return t.unsqueeze(0).transpose(1, 2)


def as_packed(t: torch.Tensor) -> torch.Tensor:
    """The [T, H, E] tensor of a [1, H, T, E] view (inverse of ``as_block``)."""
    return t[0].transpose(0, 1)


def outputs(q: torch.Tensor, out, lse, packed: bool):
    """(out, lse) buffers of a forward on queries ``q``: the given ones (as blocks) or new."""
    if out is None:
        out = _empty_like(q)
    elif packed:
        out = as_block(out)
    if lse is None:
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return out, lse


def gradients(inputs, grads, packed: bool) -> tuple:
    """(dq, dk, dv) buffers of a backward on q, k, v: the given ones (as blocks) or new."""
    return tuple(_empty_like(t) if g is None else (as_block(g) if packed else g)
                 for t, g in zip(inputs, grads))


@dataclasses.dataclass(frozen=True)
class DenseCall:
    """Query rows ``rows`` vs key rows ``keys`` (slices) of dense blocks, masked."""

    rows: slice
    keys: slice
    causal: bool
    window: Window | None = None

    def forward(self, kernel, q, k, v, scale, dropout=None, outputs=(None, None)):
        """(out, lse) of the call's query rows, written into ``outputs`` when given."""
        r, c = self.rows, self.keys
        out, lse = outputs
        return kernel.forward(q[:, :, r], k[:, :, c], v[:, :, c], causal=self.causal, scale=scale,
                              window=self.window, dropout=dropout, out=out, lse=lse)

    def forward_into(self, kernel, outputs, q, k, v, scale, dropout=None):
        """``forward`` written into ``outputs`` (out, lse of the call's rows)."""
        self.forward(kernel, q, k, v, scale, dropout, outputs)

    def backward(self, kernel, dout, q, k, v, out, lse, scale, dropout=None):
        """(dq of the query rows, dk and dv of the key rows), given the global out and lse."""
        return self.backward_into(kernel, (None, None, None), dout, q, k, v, out, lse, scale,
                                  dropout)

    def backward_into(self, kernel, targets, dout, q, k, v, out, lse, scale, dropout=None):
        """``backward`` writing each gradient into its rows of the given target (else new)."""
        r, c = self.rows, self.keys
        dq, dk, dv = (None if t is None else t[:, :, span]
                      for t, span in zip(targets, (r, c, c)))
        return kernel.backward(dout[:, :, r], q[:, :, r], k[:, :, c], v[:, :, c], out[:, :, r],
                               lse[:, :, r].contiguous(), causal=self.causal, scale=scale,
                               window=self.window, dropout=dropout, dq=dq, dk=dk, dv=dv)

    def backward_rows(self, query_rows, targets, k, v) -> list:
        """[dK, dV] of the call (as ``backward_into``); its dQ summed by ``query_rows``."""
        c = self.keys
        grads = [_empty_like(like[:, :, c]) if t is None else t[:, :, c]
                 for t, like in zip(targets, (k, v))]
        query_rows.call(self.rows, k[:, :, c], v[:, :, c], *grads, causal=self.causal)
        return grads

    def pairs(self, s_q: int, s_kv: int) -> float:
        """Query-key pairs the call computes on blocks of ``s_q`` queries and ``s_kv`` keys."""
        n_q, n_k = (len(range(*part.indices(n))) for part, n in ((self.rows, s_q),
                                                                 (self.keys, s_kv)))
        return call_pairs(n_q, n_k, self.causal, self.window)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedCall:
    """One varlen kernel call: packed query rows ``rows`` vs key rows ``keys`` (index tensors
    grouped by sequence, slices, or None for all), split into sequences by ``seqlens``."""

    rows: torch.Tensor | slice | None
    keys: torch.Tensor | slice | None
    seqlens: Seqlens
    causal: bool
    window: Window | None = None

    def forward(self, kernel, q, k, v, scale, dropout=None, outputs=(None, None)):
        """(out, lse) of the call's query rows, written into ``outputs`` when given."""
        out_rows, lse_rows = outputs
        o, lse = kernel.varlen_forward(
            _take(q, self.rows), _take(k, self.keys), _take(v, self.keys), self.seqlens,
            causal=self.causal, scale=scale, window=self.window,
            out=None if out_rows is None else as_packed(out_rows),
            lse=None if lse_rows is None else lse_rows[0],
        )
        return as_block(o), lse.unsqueeze(0)

    def forward_into(self, kernel, outputs, q, k, v, scale, dropout=None):
        """``forward`` written into ``outputs`` (out, lse of the call's rows)."""
        self.forward(kernel, q, k, v, scale, dropout, outputs)

    def backward(self, kernel, dout, q, k, v, out, lse, scale, dropout=None,
                 targets=(None, None, None)):
        """(dq, dk, dv) of the call's rows, written into given ``targets`` of consecutive rows."""
        lse, rows = lse[0], self.rows  # [H, rows], contiguous as the kernels take it
        if isinstance(rows, torch.Tensor):
            lse = lse.index_select(1, rows)
        elif rows is not None:
            lse = lse[:, rows].contiguous()
        dq, dk, dv = (None if t is None or isinstance(span, torch.Tensor) else _take(t, span)
                      for t, span in zip(targets, (self.rows, self.keys, self.keys)))
        grads = kernel.varlen_backward(
            _take(dout, self.rows), _take(q, self.rows), _take(k, self.keys),
            _take(v, self.keys), _take(out, self.rows), lse, self.seqlens,
            causal=self.causal, scale=scale, window=self.window, dq=dq, dk=dk, dv=dv,
        )
        return tuple(as_block(g) for g in grads)

    def backward_into(self, kernel, targets, dout, q, k, v, out, lse, scale, dropout=None):
        """``backward``, each gradient also written into its rows of a given target."""
        grads = self.backward(kernel, dout, q, k, v, out, lse, scale, dropout, targets)
        for t, span, g in zip(targets, (self.rows, self.keys, self.keys), grads):
            if t is not None and isinstance(span, torch.Tensor):
                put_rows(t, span, g)
        return grads

    @property
    def pairs(self) -> float:
        """Query-key pairs the call computes (as ``DenseCall.pairs``)."""
        return sum(call_pairs(n_q, n_k, self.causal, self.window)
                   for n_q, n_k in zip(self.seqlens.lengths_q, self.seqlens.lengths_k))


def row_index(span, n: int) -> torch.Tensor:
    """The rows of ``span`` (None: all ``n``, a slice, or an index tensor) on the host."""
    if isinstance(span, torch.Tensor):
        return span.cpu()
    return torch.arange(n)[span if span is not None else slice(None)]


def most_calls_per_row(calls, rows: int) -> int:
    """The most of ``calls`` any of ``rows`` query rows is in (calls on disjoint row ranges,
    such as a step's calls on each sequence's rows, count once; a call on an index tensor
    counts for every row): how many results a row merges. A loop over the calls' ends on
    the host, no tensor and no device sync: it runs on every backward."""
    ends = []  # (row, +1) where a call's rows start, (row, -1) past their end
    for call in calls:
        whole = call.rows is None or isinstance(call.rows, torch.Tensor)
        start, stop = (0, rows) if whole else call.rows.indices(rows)[:2]
        if start < stop:
            ends += [(start, 1), (stop, -1)]
    most = depth = 0
    for _, change in sorted(ends):  # at one row, an end before a start: disjoint ranges
        depth += change
        most = max(most, depth)
    return most


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped like ``t`` in its layout (BHSE or BSHE)."""
    return layout_of(t).empty(t.shape, dtype=t.dtype, device=t.device)


def _take(t: torch.Tensor, rows) -> torch.Tensor:
    packed = as_packed(t)
    if isinstance(rows, torch.Tensor):
        return packed.index_select(0, rows)
    return packed if rows is None else packed[rows]


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The rows [starts[i], starts[i] + lengths[i]) of every i, concatenated."""
    shift = starts - (torch.cumsum(lengths, 0) - lengths)
    return torch.arange(int(lengths.sum())) + torch.repeat_interleave(shift, lengths)


def packed_call(rows, row_counts, keys, key_counts, *, causal: bool, tokens: tuple[int, int],
                device, window: Window | None = None) -> PackedCall | None:
    """The call of query ``rows`` vs key ``keys`` over the sequences that have both (or None)."""
    kept = (row_counts > 0) & (key_counts > 0)
    if not bool(kept.any()):
        return None
    rows = rows[torch.repeat_interleave(kept, row_counts)]
    keys = keys[torch.repeat_interleave(kept, key_counts)]
    row_counts, key_counts = row_counts[kept], key_counts[kept]
    seqlens = Seqlens(_cumulative(row_counts), _cumulative(key_counts))
    return PackedCall(_index(rows, tokens[0], device), _index(keys, tokens[1], device), seqlens,
                      causal, window)


def _cumulative(counts: torch.Tensor) -> tuple[int, ...]:
    return (0, *torch.cumsum(counts, 0).tolist())


def _index(rows: torch.Tensor, tokens: int, device) -> torch.Tensor | slice | None:
    """``rows`` as a call takes them: None for all ``tokens``, a slice, or an index tensor."""
    start = int(rows[0])
    if torch.equal(rows, torch.arange(start, start + len(rows))):
        return None if (start, len(rows)) == (0, tokens) else slice(start, start + len(rows))
    return rows.to(device)


def fold_calls(calls, kernel, merged: Merged, q, k, v, scale, streams=None) -> None:
    """Fold every call's (out, lse) on the blocks q, k, v into ``merged``."""
    for i, call in enumerate(calls):
        dropout = streams and streams(i)
        outputs = merged.into(call.rows)
        if outputs is not None:  # the rows' first block: the kernel writes the result
            call.forward_into(kernel, outputs, q, k, v, scale, dropout)
            continue
        o, lse = call.forward(kernel, q, k, v, scale, dropout)
        merged.add(o, lse, rows=call.rows)
        del o, lse  # free the call's output before the next kernel call


def call_grads(call, kernel, dq_sum: Sum, args, dropout=None, targets=(None, None)):
    """(dK, dV) of ``call`` on ``args``, written into given ``targets``; dQ into ``dq_sum``."""
    if dq_sum.in_kernel is not None:
        return call.backward_rows(dq_sum.in_kernel, targets, *args[2:4])
    dq = dq_sum.into(call.rows)
    dq_b, *grads = call.backward_into(kernel, (dq, *targets), *args, dropout)
    if dq is None:
        dq_sum.add(call.rows, dq_b)
    return grads


def backward_calls(calls, kernel, dq_sum: Sum, args, sums, streams=None) -> None:
    """Every call's backward (as ``call_grads``), dK and dV into the ``Sum``s ``sums``."""
    grad_dtype = args[2].dtype  # a kernel's dK/dV take k's dtype
    for i, call in enumerate(calls):
        targets = [s.into(call.keys, grad_dtype) for s in sums]
        grads = call_grads(call, kernel, dq_sum, args, streams and streams(i), targets)
        for s, target in zip(sums, targets):  # no name keeps a gradient into the next call
            if target is None:
                s.add(call.keys, grads[0])
            del grads[0]
    for s in sums:
        s.finish()


def take(t: torch.Tensor, rows) -> torch.Tensor:
    """Rows ``rows`` of a logical [B, H, S, E] tensor (a view for slices)."""
    if rows is None:
        return t
    return take_rows(t, rows) if isinstance(rows, torch.Tensor) else t[:, :, rows]


def add_rows(acc: torch.Tensor, rows, g: torch.Tensor) -> None:
    """acc[rows] += g along the sequence dim (an index tensor's rows distinct, as calls' are)."""
    if not isinstance(rows, torch.Tensor):
        take(acc, rows).add_(g)
        return
    tokens = _token_rows(acc)
    if tokens is None:
        acc.index_add_(2, rows, g.to(acc.dtype))
    else:  # a sorted accumulate of whole token rows: 2-3x faster than index_add_ on an H200
        g = g.to(acc.dtype)[0].transpose(0, 1).reshape(len(rows), -1)
        tokens.index_put_((rows,), g, accumulate=True)


def _token_rows(t: torch.Tensor) -> torch.Tensor | None:
    """A [S, H*E] view of a [1, H, S, E] tensor held token-major (a packed block), or None."""
    if t.shape[0] != 1:
        return None
    tokens = t[0].transpose(0, 1)
    return tokens.view(tokens.shape[0], -1) if tokens.is_contiguous() else None


def put_rows(acc: torch.Tensor, rows, g: torch.Tensor) -> None:
    """acc[rows] = g along the sequence dim."""
    if isinstance(rows, torch.Tensor):
        acc.index_copy_(2, rows, g.to(acc.dtype))
    else:
        take(acc, rows).copy_(g)


def zero_outside(t: torch.Tensor, rows) -> None:
    """Zero the sequence rows of ``t`` outside ``rows`` (an index tensor: all; None: none)."""
    if isinstance(rows, torch.Tensor):
        t.zero_()
        return
    if rows is None or rows == slice(None):
        return
    start, stop, _ = rows.indices(t.shape[2])
    t[:, :, :start].zero_()
    t[:, :, stop:].zero_()


def dq_sum_of(kernel, target: torch.Tensor, calls, args, dropout=None) -> "Sum":
    """The ``Sum`` into ``target`` of the dQ of ``calls``: inside the kernel where it can
    (``Kernel.query_rows``: dense calls, no window, causal ones square, no dropout)."""
    dout, q, k, _, out, lse, scale = args
    s_q, s_kv = q.shape[2], k.shape[2]
    in_kernel = None
    if calls and dropout is None and all(_rows_in_kernel(c, s_q, s_kv) for c in calls):
        spans = [(*c.rows.indices(s_q)[:2], c.causal) for c in calls]
        if kernel.query_rows is not None:
            in_kernel = kernel.query_rows(q, dout, out, lse, scale=scale, spans=spans)
    return Sum(target, most_calls_per_row(calls, s_q), in_kernel)


def _rows_in_kernel(call, s_q: int, s_kv: int) -> bool:
    if not isinstance(call, DenseCall) or call.window is not None:
        return False
    return not call.causal or len(range(s_q)[call.rows]) == len(range(s_kv)[call.keys])


class Sum:
    """Contributions of calls to one gradient summed into ``target``: by the kernel
    (``in_kernel``), else straight into it when at most two come (no rounding an fp32 sum
    would not make), else in fp32."""

    def __init__(self, target: torch.Tensor, contributions: int, in_kernel=None):
        self.target, self.in_kernel = target, in_kernel
        direct = contributions <= 2 or target.dtype == torch.float32 or in_kernel is not None
        self.acc = target if direct else layout_of(target).empty(
            target.shape, dtype=torch.float32, device=target.device)
        self._empty = True

    def into(self, rows, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Where the next call may write its gradient of ``rows`` itself (None: ``add`` it)."""
        direct = self._empty and self.acc is self.target
        if not direct or dtype not in (None, self.target.dtype):
            return None
        zero_outside(self.target, rows)
        self._empty = False
        return self.target

    def add(self, rows, g: torch.Tensor) -> None:
        """Add a call's gradient of ``rows``."""
        if self._empty:
            zero_outside(self.acc, rows)
            put_rows(self.acc, rows, g)
            self._empty = False
        else:
            add_rows(self.acc, rows, g)

    def finish(self) -> None:
        """Write the sum into the target (zeros when nothing came)."""
        if self.in_kernel is not None:
            self.in_kernel.finish(self.target)
            self.in_kernel = None
        elif self._empty:
            self.target.zero_()
        elif self.acc is not self.target:
            self.target.copy_(self.acc)
        self.acc = None


def part_call(packing, source: int, q_span, k_span, causal: bool) -> PackedCall | None:
    """The call of this rank's rows ``q_span`` = (start, stop) of every sequence's part vs
    rows ``k_span`` of rank ``source``'s part of it, both cut to the real tokens."""
    (q0, q1), (k0, k1), starts, split = _part_spans(packing, source, q_span, k_span, causal)
    return packed_call(ranges(starts + q0, q1 - q0), q1 - q0, ranges(starts + k0, k1 - k0), k1 - k0,
                       causal=causal, tokens=(split.tokens, split.tokens), device=split.device)


# A part call on the scattered rows of at most this many sequences runs as a call on each
# sequence's consecutive rows. On an H200 (benchmarks.virtual_ranks) the gathers and index
# kernels of one call on scattered rows took 1.5-2.2 ms of a rank's step per cut document
# past the first on batch (d) at P = 4; calls per sequence over three documents at P = 8
# left ranks waiting on the host (its launches, 10 ms a step). A group of ``assign.plan``
# mostly cuts one or two documents.
SEQUENCE_CALLS = 2


def part_calls(packing, source: int, q_span, k_span, causal: bool) -> list[PackedCall]:
    """``part_call`` as a list of calls: one per sequence where its rows or keys are
    scattered over at most ``SEQUENCE_CALLS`` sequences (each call on consecutive rows)."""
    call = part_call(packing, source, q_span, k_span, causal)
    scattered = call is not None and (isinstance(call.rows, torch.Tensor)
                                      or isinstance(call.keys, torch.Tensor))
    if not scattered or len(call.seqlens.lengths_q) > SEQUENCE_CALLS:
        return [] if call is None else [call]
    (q0, q1), (k0, k1), starts, split = _part_spans(packing, source, q_span, k_span, causal)
    calls = []
    for a, b, c, d in zip((starts + q0).tolist(), (starts + q1).tolist(),
                          (starts + k0).tolist(), (starts + k1).tolist()):
        if b > a and d > c:
            calls.append(PackedCall(slice(a, b), slice(c, d), Seqlens((0, b - a), (0, d - c)),
                                    causal))
    return calls


def _part_spans(packing, source: int, q_span, k_span, causal: bool):
    """((q0, q1), (k0, k1), starts, split): per sequence the local rows of the part call."""
    split = packing.split
    q0, q1 = _real(q_span, split.counts[packing.rank])
    k0, k1 = _real(k_span, split.counts[source])
    if causal:  # top-left: keys past the last query are seen by none (kernels get squares)
        k1 = torch.minimum(k1, k0 + q1 - q0)
    return (q0, q1), (k0, k1), split.offsets[:-1], split


def _real(span, real: torch.Tensor):
    stop = torch.minimum(torch.as_tensor(span[1]), real)
    return torch.minimum(torch.as_tensor(span[0]), stop), stop
