"""AttentionSpec: everything that determines one attention problem, checked in one place."""

from __future__ import annotations

import collections
import dataclasses
import math

import torch

from .layout import (Layout, check_cu_seqlens, check_offsets, check_padding, seqlens_of,
                     tensor_layout)
from .mask import Window, call_pairs

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FORWARD_AND_BACKWARD = 3.5  # matmul FLOPs of a forward and its backward over the forward's


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Shape, dtype and options of scaled-dot-product attention on logical [B, H, S, E].

    ``causal`` and ``window`` are top-left aligned. For ``thd``, ``batch`` is 1, ``q_len`` and
    ``kv_len`` are packed token counts and ``cu_seqlens`` (and ``cu_seqlens_padded``) delimit
    sequences: this rank's under a schedule that splits tokens, ``packing`` being its part of
    the global packing. ``mask`` (``sdpa_fusion.masks``) has causal and window folded in.
    """

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    scale: float | None = None
    dropout_p: float = 0.0
    layout: Layout = Layout.BHSE
    cu_seqlens: tuple[int, ...] | None = None
    cu_seqlens_padded: tuple[int, ...] | None = None
    window: Window | None = None
    packing: object = None
    mask: object = None  # an ``sdpa_fusion.masks.Mask``

    def __post_init__(self):
        object.__setattr__(self, "layout", Layout.of(self.layout))
        object.__setattr__(self, "window", Window.of(self.window))

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def groups(self) -> int:
        """Query heads per K/V head (1 without GQA)."""
        return self.heads // self.kv_heads

    def replace(self, **changes) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)

    def validate(self) -> "AttentionSpec":
        """Raise ValueError naming the argument and the fix for any bad combination."""
        for name in ("batch", "heads", "kv_heads", "q_len", "kv_len", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.head_dim % 8:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of 8 (attention "
                             "kernels load 16-byte vectors); pad the head dim to "
                             f"{8 * math.ceil(self.head_dim / 8)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads} "
                             "for grouped-query attention; choose kv_heads among the divisors of "
                             f"{self.heads}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype} is not supported; use torch.bfloat16 or "
                             "torch.float16 (torch.float32 for the reference kernel)")
        if not (_is_number(self.dropout_p) and 0.0 <= self.dropout_p < 1.0):
            raise ValueError(f"dropout_p={self.dropout_p!r} must be in [0, 1): a Python number, "
                             "the probability of dropping an attention weight (0.0: no dropout)")
        if self.scale is not None and not (_is_number(self.scale) and math.isfinite(self.scale)
                                           and self.scale > 0):
            raise ValueError(f"scale={self.scale!r} must be a positive number or None: finite and "
                             "> 0 (None means 1/sqrt(head_dim))")
        if self.layout.is_varlen:
            self._validate_varlen()
        if self.mask is not None:
            self._validate_mask()
        return self

    def _validate_mask(self) -> None:
        from .masks import Mask

        if not isinstance(self.mask, Mask):
            raise ValueError(f"mask={self.mask!r} must be built with sdpa_fusion.masks, e.g. "
                             f"masks.causal() & masks.document_ids(ids)")
        if self.dropout_p > 0:
            raise ValueError(f"dropout_p={self.dropout_p} is not supported with mask=; use "
                             f"dropout_p=0")
        if self.causal or self.window is not None:
            raise ValueError("a spec with mask= has causal and window inside the mask; use "
                             "masks.causal() & masks.window(left, right) & mask")

    def _validate_varlen(self) -> None:
        if self.batch != 1:
            raise ValueError(f"layout='thd' packs sequences along T; batch must be 1, got {self.batch}")
        if self.cu_seqlens is None:
            raise ValueError("layout='thd' needs cu_seqlens= (cumulative sequence lengths)")
        if self.dropout_p > 0:
            raise ValueError(f"dropout_p={self.dropout_p} is not supported with layout='thd'; use "
                             "dropout_p=0, or pad the sequences to one length and use "
                             "layout='bshe'")
        if self.q_len != self.kv_len:
            raise ValueError(f"layout='thd' needs q and k/v packed alike; got {self.q_len} query "
                             f"tokens and {self.kv_len} key tokens")
        padded = self.cu_seqlens_padded is not None
        check_offsets("cu_seqlens", list(self.cu_seqlens), self.q_len, exact=not padded)
        if padded:
            check_offsets("cu_seqlens_padded", list(self.cu_seqlens_padded), self.q_len)
            check_padding(list(self.cu_seqlens), list(self.cu_seqlens_padded))

    def sequences(self) -> list[tuple[int, int]]:
        """(start, length) of every packed sequence (``thd`` only)."""
        starts = self.cu_seqlens_padded or self.cu_seqlens
        return [(s, n) for s, n in zip(starts, seqlens_of(list(self.cu_seqlens)))]

    def flops(self, *, backward: bool = False) -> float:
        """Matmul FLOPs, 4*h*e per (query, key) pair kept; 3.5x for forward+backward."""
        if self.mask is not None:
            from .mask_plan import spec_pairs

            pairs = spec_pairs(self)
        else:
            lengths = [(n, n) for _, n in self.sequences()] if self.layout.is_varlen \
                else [(self.q_len, self.kv_len)] * self.batch
            pairs = sum(c * call_pairs(n_q, n_k, self.causal, self.window)
                        for (n_q, n_k), c in collections.Counter(lengths).items())
        f = 4.0 * self.heads * pairs * self.head_dim
        return f * FORWARD_AND_BACKWARD if backward else f

    @classmethod
    def from_tensors(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     layout: Layout | str = "auto", causal: bool = False,
                     scale: float | None = None, dropout_p: float = 0.0,
                     cu_seqlens: torch.Tensor | None = None,
                     cu_seqlens_padded: torch.Tensor | None = None, window=None,
                     mask=None) -> "AttentionSpec":
        """Build and validate the spec of q, k, v, each checked against ``layout``; with "auto"
        the spec takes q's layout (the caller brings k and v to it: ``spec.layout.to(t)``)."""
        layouts = [tensor_layout(name, t, layout) for name, t in zip("qkv", (q, k, v))]
        if len({t.is_varlen for t in layouts}) > 1:
            shown = ", ".join(f"{n} {t.value}" for n, t in zip("qkv", layouts))
            raise ValueError(f"q, k, v must be all packed [T, H, E] (layout 'thd') or all logical "
                             f"[B, H, S, E], got {shown}")
        layout = layouts[0]
        if k.shape != v.shape:
            raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must have the same shape")
        if q.dtype != k.dtype or q.dtype != v.dtype:
            raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
                             "cast them to the same dtype")
        if len({q.device, k.device, v.device}) != 1:
            raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
        if layout.is_varlen:
            (t_q, h, e), (t_k, h_kv, e_k) = q.shape, k.shape
            b, padded = 1, None
            if cu_seqlens_padded is not None:
                padded = tuple(check_cu_seqlens("cu_seqlens_padded", cu_seqlens_padded, t_q,
                                                device=q.device))
            # With padding the real sequences end before T; cu_seqlens_padded ends at T.
            cu = tuple(check_cu_seqlens("cu_seqlens", cu_seqlens, t_q, device=q.device,
                                        exact=padded is None))
        else:
            (b, h, t_q, e), (b_k, h_kv, t_k, e_k) = q.shape, k.shape
            if b_k != b:
                raise ValueError(f"q has batch {b} but k and v have batch {b_k}; they must match")
            cu = padded = None
        if e_k != e:
            raise ValueError(f"q has head dim {e} but k and v have {e_k}; q, k and v must share "
                             "the head dim")
        return cls(
            batch=b, heads=h, kv_heads=h_kv, q_len=t_q, kv_len=t_k, head_dim=e,
            dtype=q.dtype, causal=bool(causal), scale=scale,
            dropout_p=float(dropout_p) if _is_number(dropout_p) else dropout_p,
            layout=layout, cu_seqlens=cu, cu_seqlens_padded=padded, window=window, mask=mask,
        ).validate()


def _is_number(value) -> bool:
    """Whether ``value`` is a Python int or float (not a bool, a tensor or a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
