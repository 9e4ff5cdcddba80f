"""Logical [B, H, S, E] tensors as the memory buffers that collectives move, and back.

A BSHE tensor is a [B, S, H, E] buffer seen as [B, H, S, E]. ``to_buffer`` is a view for a
tensor in the layout, so nothing changes layout on the way; ``from_buffer`` sees it again.
"""

from __future__ import annotations

import torch

from sdpa_fusion.layout import Layout


def buffer_shape(shape, layout: Layout) -> list[int]:
    """The shape in memory order of a logical ``shape``."""
    return [shape[d] for d in layout.memory_order]


def to_buffer(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The contiguous memory-order buffer of logical ``t`` (a view when ``t`` has ``layout``)."""
    return t.permute(layout.memory_order).contiguous()


def from_buffer(buf: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The logical [B, H, S, E] view of a memory-order buffer."""
    return buf.permute(layout.logical_order)


def views(flat: torch.Tensor, shapes, layout: Layout) -> list[torch.Tensor]:
    """Logical views, in ``layout``, of consecutive pieces of the 1-D buffer ``flat``."""
    out, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        out.append(from_buffer(flat[offset:offset + n].view(buffer_shape(shape, layout)), layout))
        offset += n
    return out
