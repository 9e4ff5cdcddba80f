"""Merging partial attention results by their log-sum-exp: the one merge of every sequence
schedule.

A query row attended over key blocks K_1, K_2, ... separately has, per block, an output O_i
(softmax over that block only) and a log-sum-exp L_i. Over all blocks together:

    L = log(sum_i exp(L_i)),    O = sum_i exp(L_i - L) O_i

A ring loop keeps fp32 accumulators and folds in one block at a time:

    out_acc, lse_acc = accumulators(q)                 # zeros, -inf
    for each step:
        block_out, block_lse = kernel.forward(q, k_blk, v_blk, ...)
        out_acc, lse_acc = fold(out_acc, lse_acc, block_out, block_lse)  # all queries
        out_acc, lse_acc = fold(out_acc, lse_acc, o2, l2, rows=slice(s // 2, None))
    out = finish(out_acc, q.dtype, layout)

On CUDA tensors the merge runs the ``LseMerge`` fusion when nvFuser is installed, otherwise
the same fp32 math in torch.
"""

from __future__ import annotations

import torch

from .kernels.base import layout_of
from .kernels.nvfuser import import_error
from .layout import Layout, has_layout


def accumulators(q: torch.Tensor, layout: Layout | str | None = None):
    """(out_acc, lse_acc) for the queries ``q`` [B,H,S,E]: fp32 zeros in ``layout`` (q's own by
    default) and fp32 -inf [B,H,S] (no key seen yet)."""
    layout = layout_of(q) if layout is None else Layout.of(layout)
    b, h, s, _ = q.shape
    out = layout.empty(q.shape, dtype=torch.float32, device=q.device).zero_()
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                  block_lse: torch.Tensor):
    """(out, lse) of two partial results together: out fp32 in ``out``'s layout, lse fp32.

    Rows that no key of either part reaches (both lse -inf) come out as 0 and -inf, not NaN.
    """
    _check_shapes(out, lse, block_out, block_lse)
    if out.is_cuda and import_error() is None:
        return _merge_fused(out, lse, block_out, block_lse)
    return _merge_torch(out, lse, block_out, block_lse)


def fold(out_acc: torch.Tensor, lse_acc: torch.Tensor, block_out: torch.Tensor,
               block_lse: torch.Tensor, rows: slice | torch.Tensor | None = None):
    """Fold a block's (out, lse) into the accumulators over the query ``rows`` (a slice of the
    sequence dim, or an index tensor of its rows, e.g. the tokens of packed sequences; all
    rows when None) and return the accumulators: the merged tensors themselves when every
    row is merged, else ``out_acc`` and ``lse_acc`` updated in place."""
    if isinstance(rows, torch.Tensor):
        new_out, new_lse = merge_partial(take_rows(out_acc, rows), lse_acc.index_select(2, rows),
                                         block_out, block_lse)
        out_acc.index_copy_(2, rows, new_out)
        lse_acc.index_copy_(2, rows, new_lse)
        return out_acc, lse_acc
    if rows is None or rows == slice(None):
        return merge_partial(out_acc, lse_acc, block_out, block_lse)
    out_view, lse_view = out_acc[:, :, rows], lse_acc[:, :, rows]
    new_out, new_lse = merge_partial(out_view, lse_view, block_out, block_lse)
    out_view.copy_(new_out)
    lse_view.copy_(new_lse)
    return out_acc, lse_acc


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The sequence rows ``rows`` (an index tensor) of a logical [B, H, S, E] tensor, gathered
    in the memory order of ``t`` (BHSE or BSHE)."""
    layout = layout_of(t)
    order = layout.memory_order
    picked = t.permute(order).index_select(order.index(2), rows)
    return picked.permute(layout.logical_order)


def finish(out_acc: torch.Tensor, dtype: torch.dtype, layout: Layout | str) -> torch.Tensor:
    """The accumulated output cast to ``dtype`` in ``layout``."""
    return Layout.of(layout).to(out_acc.to(dtype))


def _check_shapes(out, lse, block_out, block_lse) -> None:
    if out.shape != block_out.shape:
        raise ValueError(
            f"block_out {list(block_out.shape)} must have the shape of out {list(out.shape)}; "
            f"pass rows= to merge a block into part of the sequence"
        )
    for name, t in (("lse", lse), ("block_lse", block_lse)):
        if t.shape != out.shape[:3]:
            raise ValueError(f"{name} {list(t.shape)} must be out's [B, H, S] = {list(out.shape[:3])}")


def _merge_torch(out, lse, block_out, block_lse):
    lse, block_lse = lse.float(), block_lse.float()
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isneginf(m), 0.0, m)
    w, w_block = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w + w_block
    new_lse = m + torch.log(total)
    inv = 1.0 / torch.where(total == 0, 1.0, total)
    new_out = out.float() * (w * inv).unsqueeze(-1) + block_out.float() * (w_block * inv).unsqueeze(-1)
    return layout_of(out).to(new_out), new_lse


def _merge_fused(out, lse, block_out, block_lse):
    from .definitions import LseMerge

    layout = layout_of(out)
    block_out = layout.to(block_out)
    dense = has_layout(out, layout) and lse.is_contiguous() and block_lse.is_contiguous()
    fd = LseMerge.cached(
        out.shape[1], out.shape[3], layout=layout, acc_dtype=out.dtype,
        block_dtype=block_out.dtype, dense=dense,
    )
    return tuple(fd.execute([out, lse.float(), block_out, block_lse.float()]))
