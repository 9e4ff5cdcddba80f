"""Ways to run packed (THD) sequences through a kernel, each a ``Kernel`` (pass one as
``attention(..., kernel=...)``, or let ``auto`` pick one: ``choice``):

- ``Varlen(kernel)``: the kernel's own varlen call, one launch for all sequences;
- ``PerSequence(kernel)``: one dense call per sequence: the fastest dense kernel at full
  speed on long sequences, but every call costs host time;
- ``Padded(kernel)``: one dense call on the sequences padded to the longest (free when they
  have one length and fill the pack, a copy in and out otherwise). Padding keys sit after
  each sequence, so this needs sequences of one shape, or as many queries as keys and a mask
  that hides later keys (causal, or a window whose right side is 0); a call it cannot pad
  exactly (a schedule's block of other shapes) goes through the kernel's own varlen call;
- ``Split(kernel, short, min_long)``: sequences of ``min_long`` tokens or more one by one
  through ``kernel``, the others in one varlen call of ``short``.

``estimate(spec)`` gives each way's forward+backward seconds by the cost model (``cost``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..mask import band
from ..spec import AttentionSpec
from .base import Kernel, Seqlens, backward_each, forward_each, get
from .cost import COPY_BYTES_PER_S, per_sequence_seconds, sequence_work, speed, varlen_seconds
from .pieces import packed_lse


def has_varlen(kernel: Kernel) -> bool:
    """Whether ``kernel`` runs packed sequences in one call (not one by one)."""
    return kernel.native_varlen


class Way(Kernel):
    """A way of running packed sequences through ``kernel`` (dense calls go straight to it,
    and every call of the kernel stays inside its limits)."""

    way = ""
    limits = None  # the kernel's own apply to every call of it

    def __init__(self, kernel: Kernel | str):
        self.kernel = get(kernel)
        self.name = f"{self.kernel.name} {self.way}"
        self.gpu_only = self.kernel.gpu_only
        self.supports_window = self.kernel.supports_window

    def unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        return self.kernel.unavailable_reason(spec, device)

    def too_long(self, rows: int, keys: int, head_dim: int) -> str | None:
        return self.kernel.too_long(rows, keys, head_dim)

    def _forward(self, q, k, v, *, causal, scale, window, dropout, out, lse):
        return self.kernel.forward(q, k, v, causal=causal, scale=scale, window=window,
                                   dropout=dropout, out=out, lse=lse)

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, window, dropout, dq, dk, dv):
        return self.kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                    window=window, dropout=dropout, dq=dq, dk=dk, dv=dv)

    def estimate(self, spec: AttentionSpec) -> float:
        """Estimated seconds of a forward+backward of packed ``spec`` (the module's model)."""
        raise NotImplementedError

    def host_seconds(self, spec: AttentionSpec) -> float:
        """The host time of one forward+backward of packed ``spec`` (its kernel calls)."""
        return speed(self.kernel, "dense").host_s


class Varlen(Way):
    """The kernel's own varlen call."""

    way = "varlen"

    def estimate(self, spec):
        return varlen_seconds(self.kernel, sequence_work(spec), spec.heads)

    def host_seconds(self, spec):
        return speed(self.kernel, "varlen").host_s

    def _varlen_forward(self, q, k, v, seqlens, *, causal, scale, window, out=None, lse=None):
        return self.kernel.varlen_forward(q, k, v, seqlens, causal=causal, scale=scale,
                                          window=window, out=out, lse=lse)

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens, *, causal, scale, window,
                         dq=None, dk=None, dv=None):
        return self.kernel.varlen_backward(dout, q, k, v, out, lse, seqlens, causal=causal,
                                           scale=scale, window=window, dq=dq, dk=dk, dv=dv)


class PerSequence(Way):
    """One dense call of the kernel per sequence (the base class's varlen loop)."""

    way = "per-sequence"

    def estimate(self, spec):
        return per_sequence_seconds(self.kernel, sequence_work(spec))

    def host_seconds(self, spec):
        return len(sequence_work(spec)) * speed(self.kernel, "dense").host_s


class Split(Way):
    """Sequences of at least ``min_long`` tokens one by one through ``kernel`` (dense), the
    others in one varlen call of ``short``."""

    way = "per-sequence"

    def __init__(self, kernel: Kernel | str, short: Kernel | str, min_long: int):
        super().__init__(kernel)
        self.short, self.min_long = get(short), min_long
        self.name = f"{self.kernel.name} per-sequence from {min_long} tokens + {self.short.name} varlen"

    def unavailable_reason(self, spec, device):
        return super().unavailable_reason(spec, device) or self.short.unavailable_reason(spec, device)

    def estimate(self, spec):
        work = sequence_work(spec)
        return (per_sequence_seconds(self.kernel, [w for w in work if w[0] >= self.min_long])
                + varlen_seconds(self.short, [w for w in work if w[0] < self.min_long], spec.heads))

    def host_seconds(self, spec):
        long = sum(n >= self.min_long for n, _ in sequence_work(spec))
        return long * speed(self.kernel, "dense").host_s + speed(self.short, "varlen").host_s

    def _varlen_forward(self, q, k, v, seqlens, *, causal, scale, window, out=None, lse=None):
        short, long = split_sequences(seqlens, self.min_long)
        out, lse = self.short.varlen_forward(q, k, v, short, causal=causal, scale=scale,
                                             window=window, out=out, lse=lse)
        forward_each(self.kernel, q, k, v, long, out, lse, causal=causal, scale=scale,
                     window=window)
        return out, lse

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens, *, causal, scale, window,
                         dq=None, dk=None, dv=None):
        short, long = split_sequences(seqlens, self.min_long)
        grads = self.short.varlen_backward(dout, q, k, v, out, lse, short, causal=causal,
                                           scale=scale, window=window, dq=dq, dk=dk, dv=dv)
        backward_each(self.kernel, dout, q, k, v, out, lse, long, grads, causal=causal,
                      scale=scale, window=window)
        return grads


PIECE_ROWS = 128  # the query rows of a varlen kernel's tile (FA2, FA4, cuDNN: 128 or fewer)


@functools.lru_cache(maxsize=64)
def split_sequences(seqlens: Seqlens, min_long: int):
    """(the ``Seqlens`` of the short sequences, with the tokens of the long ones as sequences
    without keys or without queries, ((query start, stop), (key start, stop)) of the long
    ones). The long ones' tokens come in pieces of the longest short sequence or one tile
    (``PIECE_ROWS``), whichever is longer: no wider launch, and not one sequence per token
    when no sequence is short (a 24K-token call: 48K sequences, 15 s in FA4's varlen)."""
    pairs = list(zip(seqlens.cu_q, seqlens.cu_k, seqlens.lengths_q, seqlens.lengths_k))
    is_long = [bool(n_q and n_k and max(n_q, n_k) >= min_long) for *_, n_q, n_k in pairs]
    piece = max([max(n_q, n_k) for (*_, n_q, n_k), lng in zip(pairs, is_long) if not lng]
                + [PIECE_ROWS])
    cu_q, cu_k, long = [seqlens.cu_q[0]], [seqlens.cu_k[0]], []

    def add(n_q, n_k):
        cu_q.append(cu_q[-1] + n_q)
        cu_k.append(cu_k[-1] + n_k)

    for (qa, ka, n_q, n_k), lng in zip(pairs, is_long):
        if not lng:
            add(n_q, n_k)
            continue
        long.append(((qa, qa + n_q), (ka, ka + n_k)))
        for n, side in ((n_q, 0), (n_k, 1)):
            for start in range(0, n, piece):
                size = min(piece, n - start)
                add(*((size, 0) if side == 0 else (0, size)))
    return Seqlens(tuple(cu_q), tuple(cu_k)), tuple(long)


class Padded(Way):
    """One dense call of the kernel on the sequences padded to the longest."""

    way = "padded"

    def unfit_reason(self, spec: AttentionSpec) -> str | None:
        """Why padding cannot run packed ``spec`` exactly, or None."""
        return _unfit([(n, n) for _, n in spec.sequences()], band(spec.causal, spec.window))

    def unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        reason = super().unavailable_reason(spec, device)
        return reason or (self.unfit_reason(spec) if spec.layout.is_varlen else None)

    def estimate(self, spec):
        if self.unfit_reason(spec) is not None:
            return math.inf
        work = sequence_work(spec)
        if not work:
            return 0.0
        s = speed(self.kernel, "dense")
        longest, flops = max(work)
        padded_tokens = len(work) * longest
        copies = 0.0
        if padded_tokens != spec.q_len or spec.cu_seqlens_padded is not None:
            token_bytes = spec.heads * spec.head_dim * spec.dtype.itemsize
            copies = 12 * padded_tokens * token_bytes / COPY_BYTES_PER_S
        return s.host_s + len(work) * s.seconds(flops, longest) + copies

    def _varlen_forward(self, q, k, v, seqlens, *, causal, scale, window, out=None, lse=None):
        pad = padding(seqlens, q.shape[0], k.shape[0], band(causal, window), q.device)
        if pad is None:
            return self.kernel.varlen_forward(q, k, v, seqlens, causal=causal, scale=scale,
                                              window=window, out=out, lse=lse)
        if pad.count == 0:
            return super()._varlen_forward(q, k, v, seqlens, causal=causal, scale=scale,
                                           window=window, out=out, lse=lse)
        out_d, lse_d = self.kernel.forward(pad.dense(q, "q"), pad.dense(k, "k"), pad.dense(v, "k"),
                                           causal=causal, scale=scale, window=window,
                                           out=pad.dense_target(out, "q"))
        lse = packed_lse(q) if lse is None else lse
        if pad.slots["q"] is not None:  # rows outside every sequence see no key
            lse.fill_(-math.inf)
        pad.unpad_lse(lse_d, lse)
        return pad.packed(out_d, q, "q"), lse

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens, *, causal, scale, window,
                         dq=None, dk=None, dv=None):
        pad = padding(seqlens, q.shape[0], k.shape[0], band(causal, window), q.device)
        if pad is None:
            return self.kernel.varlen_backward(dout, q, k, v, out, lse, seqlens, causal=causal,
                                               scale=scale, window=window, dq=dq, dk=dk, dv=dv)
        if pad.count == 0:
            return super()._varlen_backward(dout, q, k, v, out, lse, seqlens, causal=causal,
                                            scale=scale, window=window, dq=dq, dk=dk, dv=dv)
        dq_d, dk_d, dv_d = (pad.dense_target(g, side) for g, side in zip((dq, dk, dv), "qkk"))
        grads = self.kernel.backward(
            pad.dense(dout, "q"), pad.dense(q, "q"), pad.dense(k, "k"), pad.dense(v, "k"),
            pad.dense(out, "q"), pad.pad_lse(lse), causal=causal, scale=scale, window=window,
            dq=dq_d, dk=dk_d, dv=dv_d,
        )
        return tuple(pad.packed(g, t, side) for g, t, side in zip(grads, (q, k, v), "qkk"))


@dataclasses.dataclass(frozen=True)
class Padding:
    """Where the tokens of packed sequences sit in a dense [N, H, m, E] batch, m =
    ``length[side]`` ("q" or "k"): ``tokens[side]`` are the packed rows of the real tokens,
    ``slots[side]`` their rows in the flat [N*m] batch (both None when the pack is that batch
    already: N sequences of m tokens)."""

    count: int
    length: dict
    tokens: dict
    slots: dict

    def dense(self, t: torch.Tensor, side: str) -> torch.Tensor:
        """Packed [T, H, E] -> dense BSHE [N, H, m, E], zeros in the padding."""
        shape = (self.count, self.length[side], *t.shape[1:])
        if self.slots[side] is None:
            return t.reshape(shape).transpose(1, 2)
        flat = t.new_zeros(self.count * self.length[side], *t.shape[1:])
        flat[self.slots[side]] = t[self.tokens[side]]
        return flat.view(shape).transpose(1, 2)

    def dense_target(self, t: torch.Tensor | None, side: str) -> torch.Tensor | None:
        """A given packed output buffer as a dense [N, H, m, E] view a kernel may write into,
        when the pack is that batch already and ``t`` is contiguous (else None: copied)."""
        if t is None or self.slots[side] is not None or not t.is_contiguous():
            return None
        return self.dense(t, side)

    def packed(self, dense: torch.Tensor, model: torch.Tensor, side: str) -> torch.Tensor:
        """Dense [N, H, m, E] -> packed like ``model``, zeros on tokens outside the sequences."""
        flat = dense.transpose(1, 2).reshape(self.count * self.length[side], *model.shape[1:])
        if self.slots[side] is None:
            return flat
        out = torch.zeros_like(model)
        out[self.tokens[side]] = flat[self.slots[side]]
        return out

    def unpad_lse(self, lse_d: torch.Tensor, lse: torch.Tensor) -> None:
        """Dense lse [N, H, m] into packed lse [H, T] (the real rows)."""
        flat = lse_d.transpose(0, 1).reshape(lse.shape[0], -1)
        if self.slots["q"] is None:
            lse.copy_(flat)
        else:
            lse[:, self.tokens["q"]] = flat[:, self.slots["q"]]

    def pad_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """Packed lse [H, T] -> dense [N, H, m]; 0 on padding rows (zero q, out and dout
        there give them zero gradients)."""
        if self.slots["q"] is None:
            flat = lse
        else:
            flat = lse.new_zeros(lse.shape[0], self.count * self.length["q"])
            flat[:, self.slots["q"]] = lse[:, self.tokens["q"]]
        return flat.view(lse.shape[0], self.count, self.length["q"]).transpose(0, 1).contiguous()


def _unfit(lengths: list[tuple[int, int]], mask) -> str | None:
    """Why sequences of (queries, keys) ``lengths`` cannot be padded to one dense batch."""
    real = [(n, m) for n, m in lengths if n and m]
    if len(set(real)) <= 1:  # one shape: no padding at all
        return None
    if any(n != m for n, m in real):
        return "padded: sequences of several shapes need as many queries as keys"
    if mask[1] != 0 and len({n for n, _ in real}) > 1:
        return ("padded: sequences of several lengths need a mask whose right side is 0 "
                "(causal), else padding keys would be attended")
    return None


def _rows(spans) -> torch.Tensor:
    """The rows [a, a + n) of every (a, n) of ``spans``, concatenated."""
    parts = [torch.arange(a, a + n) for a, n in spans]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@functools.lru_cache(maxsize=32)
def padding(seqlens: Seqlens, t_q: int, t_k: int, mask, device) -> Padding | None:
    """The ``Padding`` of ``seqlens``; None when padding cannot run them exactly (``_unfit``)."""
    if _unfit(list(zip(seqlens.lengths_q, seqlens.lengths_k)), mask) is not None:
        return None
    spans = [(a, b, n, m) for a, b, n, m in zip(seqlens.cu_q, seqlens.cu_k, seqlens.lengths_q,
                                                 seqlens.lengths_k) if n and m]
    count = len(spans)
    length = {"q": max((n for *_, n, _ in spans), default=0),
              "k": max((m for *_, m in spans), default=0)}
    if (t_q, t_k) == (count * length["q"], count * length["k"]) and all(
            (a, b) == (i * length["q"], i * length["k"]) for i, (a, b, *_) in enumerate(spans)):
        return Padding(count, length, {"q": None, "k": None}, {"q": None, "k": None})
    slots = {"q": _rows((i * length["q"], n) for i, (_, _, n, _) in enumerate(spans)),
             "k": _rows((i * length["k"], m) for i, (*_, m) in enumerate(spans))}
    tokens = {"q": _rows((a, n) for a, _, n, _ in spans),
              "k": _rows((b, m) for _, b, _, m in spans)}
    return Padding(count, length, {side: t.to(device) for side, t in tokens.items()},
                   {side: t.to(device) for side, t in slots.items()})
