"""Merging partial attention results by their log-sum-exp, for every sequence schedule.

A query row attended over key blocks K_1, K_2, ... has per block an output O_i and a
log-sum-exp L_i; over all blocks, L = log(sum_i exp(L_i)) and O = sum_i exp(L_i - L) O_i.
A schedule folds one block at a time into the rows it covers, in place:

    merged = Merged(out, lse, blocks=P)       # out, lse: the results (or head slices of them)
    for each step:
        block_out, block_lse = kernel.forward(q, k_blk, v_blk, ...)
        merged.add(block_out, block_lse)                       # all queries
        merged.add(o2, l2, rows=slice(s // 2, None))          # the late half only
    merged.finish()                                          # out, lse hold the result

With at most two blocks per row the merge writes straight into ``out`` (rounding once); with
more, into an fp32 accumulator. On CUDA a fold runs ``MergeWeights`` then ``WeightedSum`` in
place, else ``LseMerge`` out of place (``FOLD_PART_BYTES`` at a time); without nvFuser, torch.
"""

from __future__ import annotations

import logging

import torch

from .kernels.base import layout_of
from .kernels.nvfuser import import_error
from .layout import Layout, exact_strides, has_layout

log = logging.getLogger("sdpa_fusion")
_UNFUSED: set = set()  # WeightedSum signatures that failed to run in place here (then out of place)
FOLD_PART_BYTES = 64 << 20  # a fold that cannot run in place merges at most this much at once


def accumulators(q: torch.Tensor, layout: Layout | str | None = None):
    """(out_acc, lse_acc) for queries ``q``: fp32 zeros in ``layout`` (q's by default), -inf."""
    layout = layout_of(q) if layout is None else Layout.of(layout)
    b, h, s, _ = q.shape
    out = layout.empty(q.shape, dtype=torch.float32, device=q.device).zero_()
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


class Merged:
    """The merge of the blocks ``add``ed, into ``out`` and ``lse`` (views allowed) at ``finish``;
    ``blocks`` bounds how many blocks any row gets."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor, blocks: int):
        self.out, self.lse = out, lse
        direct = blocks <= 2 or out.dtype == torch.float32
        self.acc = out if direct else layout_of(out).empty(out.shape, dtype=torch.float32,
                                                           device=out.device)
        self._empty = True

    def into(self, rows=None):
        """(out, lse) for a kernel to write a first block of every row into; else None (add it)."""
        if not (self._empty and self.acc is self.out and _all(rows)):
            return None
        self._empty = False
        return self.out, self.lse

    def add(self, block_out, block_lse, rows=None) -> None:
        """Fold a block's (out, lse) of the query ``rows`` (slice, index tensor, None: all) in."""
        if self._empty:
            put(self.acc, self.lse, block_out, block_lse, rows)
            self._empty = False
        else:
            fold(self.acc, self.lse, block_out, block_lse, rows)

    def finish(self) -> None:
        """Write the result into ``out`` (rows no block reached: 0, lse -inf)."""
        if self._empty:
            self.out.zero_()
            self.lse.fill_(float("-inf"))
        elif self.acc is not self.out:
            self.out.copy_(self.acc)
        self.acc = None


def put(out_acc, lse_acc, block_out, block_lse, rows=None) -> None:
    """Set the accumulators to a block's (out, lse) over ``rows``: 0 and -inf elsewhere."""
    if _all(rows):
        out_acc.copy_(block_out)
        lse_acc.copy_(block_lse)
        return
    out_acc.zero_()
    lse_acc.fill_(float("-inf"))
    if isinstance(rows, torch.Tensor):
        out_acc.index_copy_(2, rows, block_out.to(out_acc.dtype))
        lse_acc.index_copy_(2, rows, block_lse)
    else:
        out_acc[:, :, rows].copy_(block_out)
        lse_acc[:, :, rows].copy_(block_lse)


def fold(out_acc: torch.Tensor, lse_acc: torch.Tensor, block_out: torch.Tensor,
         block_lse: torch.Tensor, rows: slice | torch.Tensor | None = None):
    """Fold a block's (out, lse) into the accumulators over the query ``rows`` (a slice or an
    index tensor of the sequence dim; all rows when None), in place; returns them."""
    if isinstance(rows, torch.Tensor):
        new_out, new_lse = merge_partial(take_rows(out_acc, rows), lse_acc.index_select(2, rows),
                                         block_out, block_lse)
        out_acc.index_copy_(2, rows, new_out.to(out_acc.dtype))
        lse_acc.index_copy_(2, rows, new_lse)
        return out_acc, lse_acc
    out_view, lse_view = (out_acc, lse_acc) if _all(rows) else (out_acc[:, :, rows],
                                                               lse_acc[:, :, rows])
    _check_shapes(out_view, lse_view, block_out, block_lse)
    if out_view.is_meta:
        _fold_meta(out_view, lse_view, block_lse)
    elif not (out_view.is_cuda and import_error() is None):
        _fold_torch(out_view, lse_view, block_out, block_lse)
    elif not (_folds_in_place(out_view, lse_view, block_lse)
              and _fold_fused(out_view, lse_view, block_out, block_lse)):
        _fold_by_heads(out_view, lse_view, block_out, block_lse)
    return out_acc, lse_acc


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                  block_lse: torch.Tensor):
    """(out, lse) of two partial results together: out fp32 in ``out``'s layout, lse fp32;
    rows no key reaches (both lse -inf) come out as 0 and -inf, not NaN."""
    _check_shapes(out, lse, block_out, block_lse)
    if out.is_meta:  # what the fused merge allocates, no more
        return layout_of(out).empty(out.shape, dtype=torch.float32, device=out.device), \
            torch.empty_like(lse, dtype=torch.float32)
    if out.is_cuda and import_error() is None:
        return _merge_fused(out, lse, block_out, block_lse)
    return _merge_torch(out, lse, block_out, block_lse)


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows ``rows`` (an index tensor) of logical [B, H, S, E] ``t``, in t's memory order."""
    layout = layout_of(t)
    order = layout.memory_order
    picked = t.permute(order).index_select(order.index(2), rows)
    return picked.permute(layout.logical_order)


def finish(out_acc: torch.Tensor, dtype: torch.dtype, layout: Layout | str) -> torch.Tensor:
    """The accumulated output cast to ``dtype`` in ``layout``."""
    return Layout.of(layout).to(out_acc.to(dtype))


def _all(rows) -> bool:
    return rows is None or (isinstance(rows, slice) and rows == slice(None))


def _check_shapes(out, lse, block_out, block_lse) -> None:
    if out.shape != block_out.shape:
        raise ValueError(f"block_out {list(block_out.shape)} must have the shape of out "
                         f"{list(out.shape)}; pass rows= to merge a block into part of the "
                         "sequence")
    for name, t in (("lse", lse), ("block_lse", block_lse)):
        if t.shape != out.shape[:3]:
            raise ValueError(f"{name} {list(t.shape)} must be out's [B, H, S] = {list(out.shape[:3])}")


def _weights(lse, block_lse):
    """(weight of the accumulator, weight of the block, merged lse), fp32 [B, H, S]."""
    lse, block_lse = lse.float(), block_lse.float()
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isneginf(m), 0.0, m)
    w, w_block = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w + w_block
    inv = 1.0 / torch.where(total == 0, 1.0, total)
    return w * inv, w_block * inv, m + torch.log(total)


def _merge_torch(out, lse, block_out, block_lse):
    w, w_block, new_lse = _weights(lse, block_lse)
    new_out = layout_of(out).to(block_out.float() * w_block.unsqueeze(-1))
    return new_out.addcmul_(out, w.unsqueeze(-1)), new_lse


def _fold_torch(out, lse, block_out, block_lse) -> None:
    """``_merge_torch`` into ``out`` and ``lse`` (no temporary of out's size when it is fp32)."""
    w, w_block, new_lse = _weights(lse, block_lse)
    if out.dtype == torch.float32:
        out.mul_(w.unsqueeze(-1)).addcmul_(block_out, w_block.unsqueeze(-1))
    else:  # merged in fp32, rounded once
        out.copy_(out.float() * w.unsqueeze(-1) + block_out.float() * w_block.unsqueeze(-1))
    lse.copy_(new_lse)


def _fold_meta(out, lse, block_lse) -> None:
    """A fold of data-less tensors (a dry run) allocating what the fused fold does on GPUs."""
    weights = [torch.empty_like(lse, dtype=torch.float32) for _ in range(3)]
    lse.copy_(weights[2])


def _is_dense(out, lse, block_lse, layout: Layout) -> bool:
    """Whether ``out`` is dense in ``layout`` and both lse are contiguous."""
    return has_layout(out, layout) and lse.is_contiguous() and block_lse.is_contiguous()


def _folds_in_place(out, lse, block_lse) -> bool:
    """Whether the fold can run in place (``WeightedSum``): nvFuser 0.2.36 writes its aliased
    output correctly into a dense BHSE tensor and into BSHE memory, views of some rows or
    heads too, but into a BHSE view of some rows it writes elsewhere."""
    return layout_of(out) is Layout.BSHE or _is_dense(out, lse, block_lse, Layout.BHSE)


def _fold_by_heads(out, lse, block_out, block_lse, merge=None) -> None:
    """``merge`` (``LseMerge``) out of place, copied into ``out`` and ``lse``, as many heads at
    a time as keep its fp32 output within FOLD_PART_BYTES (a small fold in one merge)."""
    merge = merge or _merge_fused
    heads = out.shape[1]
    head_bytes = out[:, :1].numel() * 4  # of the fp32 temporary, whatever out's dtype
    step = max(1, min(heads, FOLD_PART_BYTES // max(head_bytes, 1)))
    for start in range(0, heads, step):
        part = slice(start, start + step)
        new_out, new_lse = merge(out[:, part], lse[:, part], block_out[:, part],
                                 block_lse[:, part])
        out[:, part].copy_(new_out)
        lse[:, part].copy_(new_lse)


def _merge_fused(out, lse, block_out, block_lse):
    from .definitions import LseMerge

    fd, inputs = _fusion(LseMerge, out, lse, block_out, block_lse)
    return tuple(fd.execute(inputs))


def _fold_fused(out, lse, block_out, block_lse) -> bool:
    """``MergeWeights``, then ``WeightedSum`` in place; False when that cannot run here."""
    from .definitions import MergeWeights, WeightedSum

    key = (out.dtype, block_out.dtype, layout_of(out))
    if key in _UNFUSED:
        return False
    weights = MergeWeights.cached(out.shape[1])
    w_a, w_b, new_lse = weights.execute([exact_strides(t.float().contiguous(), (0, 1, 2))
                                         for t in (lse, block_lse)])
    fd, inputs = _fusion(WeightedSum, out, w_a, block_out, w_b)
    try:
        fd.execute(inputs)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 -- an nvFuser without in-place outputs
        log.warning("WeightedSum in place failed (%s: %s); merging out of place",
                    type(e).__name__, e)
        _UNFUSED.add(key)
        return False
    lse.copy_(new_lse)
    return True


def _fusion(cls, out, rows_a, block_out, rows_b):
    """The cached ``cls`` for these blocks and its inputs (rows_a, rows_b: lse or weights)."""
    layout = layout_of(out)
    block_out = layout.to(block_out)
    dense = _is_dense(out, rows_a, rows_b, layout)
    fd = cls.cached(out.shape[1], out.shape[3], layout=layout, acc_dtype=out.dtype,
                    block_dtype=block_out.dtype, dense=dense)
    inputs = [out, rows_a.float(), block_out, rows_b.float()]
    if dense:  # declared contiguous: size-1 dims (a batch of one) get their strides too
        orders = (layout.memory_order, (0, 1, 2)) * 2
        inputs = [exact_strides(t, order) for t, order in zip(inputs, orders)]
    return fd, inputs
