"""The one contract every local attention kernel serves, and the registry of kernels.

    forward(q, k, v, *, causal, scale, window=None, dropout=None, out=None, lse=None)
        -> (out, lse)
    backward(dout, q, k, v, out, lse, *, causal, scale, window=None, dropout=None,
             dq=None, dk=None, dv=None) -> (dq, dk, dv)

take dense tensors, logical [B, H, S, E] in BHSE or BSHE memory order; ``varlen_forward``
and ``varlen_backward`` take packed [T, H, E] tensors and the ``Seqlens`` that delimit them
(after the tensors; no dropout). Outputs keep the query's layout (gradients their input's);
``lse`` is fp32, [B, H, S_q] dense and [H, T_q] packed. ``causal`` and ``window`` are
aligned top-left, per sequence when packed: query i sees key j when j <= i (causal) and
i - left <= j <= i + right (window; a None side is unbounded). A row that sees no key gets
out 0 and lse -inf. K/V may have fewer heads than Q (GQA). ``backward`` takes the *global*
out and lse of the rows, so it can run block by block (ring attention). Output buffers
given as keywords (shaped, typed and laid out like the results) receive the results.

A kernel implements ``_forward`` and ``_backward`` for calls inside its ``limits`` (``pieces``
splits the others), and ``_varlen_forward``/``_varlen_backward`` when it has a varlen call
(``native_varlen``; else packed sequences run one by one through its dense call).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import hashlib
import math
import operator

import torch

from ..layout import layout_of  # noqa: F401  (used by the kernels)
from ..mask import Window, band  # noqa: F401  (part of the kernel contract)
from ..spec import AttentionSpec
from . import pieces
from .limits import Limits, too_long


class KernelUnavailable(ValueError):
    """A kernel cannot run a given spec on a given device (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Seqlens:
    """Packed sequences of one varlen kernel call: sequence i has the queries
    ``cu_q[i]:cu_q[i+1]`` and the keys ``cu_k[i]:cu_k[i+1]`` of the packed tensors."""

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]

    # made once per call's Seqlens: a pack of many sequences is read on every kernel call
    @functools.cached_property
    def lengths_q(self) -> tuple[int, ...]:
        return tuple(map(operator.sub, self.cu_q[1:], self.cu_q))

    @functools.cached_property
    def lengths_k(self) -> tuple[int, ...]:
        return tuple(map(operator.sub, self.cu_k[1:], self.cu_k))

    @functools.cached_property
    def max_q(self) -> int:
        return max(self.lengths_q, default=0)

    @functools.cached_property
    def max_k(self) -> int:
        return max(self.lengths_k, default=0)

    @functools.cached_property
    def shifts(self) -> frozenset[int]:
        """Keys minus queries of the sequences that have both."""
        return frozenset(k - q for q, k in zip(self.lengths_q, self.lengths_k) if q and k)

    @functools.cached_property
    def rows_without_keys(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) of the query rows of every sequence that has queries and no keys."""
        return tuple((qa, qb) for (qa, qb), (ka, kb) in _sequences(self) if kb == ka and qb > qa)

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_q, cu_k) as int32 tensors on ``device`` (made once per device)."""
        return _cu_tensors(self.cu_q, self.cu_k, torch.device(device))


@functools.lru_cache(maxsize=256)
def _cu_tensors(cu_q, cu_k, device):
    return (torch.tensor(cu_q, dtype=torch.int32, device=device),
            torch.tensor(cu_k, dtype=torch.int32, device=device))


@dataclasses.dataclass(eq=False)
class Dropout:
    """Dropout probability and the random stream of one kernel call.

    ``seed`` picks the stream: the reference kernel draws its keep mask from a generator
    seeded with it, in forward and again in backward; GPU kernels run their forward under the
    CUDA generator seeded with it (``on_cuda``) and leave in ``state`` what their backward
    replays (flash's philox seed and offset). ``stream(*key)``: a part's own stream.
    """

    p: float
    seed: int = 0
    state: tuple = ()

    @classmethod
    def draw(cls, p: float) -> "Dropout":
        """A stream for one attention call, seeded from torch's default generator (so ranks
        seeded alike start alike; schedules then give each rank its own ``stream``)."""
        return cls(p, int(torch.randint(0, 2**62, ()).item()))

    def stream(self, *key) -> "Dropout":
        """The stream of part ``key`` of this call (a rank's heads, a ring block): made once,
        the same in the backward."""
        streams = self.__dict__.setdefault("_streams", {})
        if key not in streams:
            digest = hashlib.blake2b(repr((self.seed, key)).encode(), digest_size=8).digest()
            streams[key] = Dropout(self.p, int.from_bytes(digest, "little") >> 2)
        return streams[key]

    def generator(self, device) -> torch.Generator:
        """A generator on ``device`` at the start of this stream."""
        return torch.Generator(device=device).manual_seed(self.seed)

    @contextlib.contextmanager
    def on_cuda(self, device):
        """Run the block with ``device``'s default CUDA generator at this stream, then restore
        it (kernels that draw from the default generator)."""
        with torch.random.fork_rng(devices=[device]):
            torch.cuda.default_generators[torch.device(device).index or 0].manual_seed(self.seed)
            yield


def on_cuda(dropout: Dropout | None, device):
    """``dropout.on_cuda(device)``, or nothing without dropout."""
    if dropout is None or dropout.p == 0:
        return contextlib.nullcontext()
    return dropout.on_cuda(device)


class Kernel(abc.ABC):
    """A local attention kernel; see the module docstring for the contract."""

    name: str = ""
    gpu_only: bool = True
    supports_dropout: bool = False
    supports_window: bool = False
    native_varlen: bool = False  # runs packed sequences in one call (else one by one)
    supports_mask: bool = False  # masked_forward/backward: an explicit bool mask (partial tiles)
    limits: Limits | None = Limits()  # what one call may take; None: no limit
    query_rows = None  # optional: one dQ summed over calls on the same query rows (FA4, sm90)
    split_heads = None  # optional: (mesh, dim) -> the kernel for head shards (nvFuser)

    def unavailable_reason(self, spec: AttentionSpec, device: torch.device) -> str | None:
        """Why this kernel cannot run ``spec`` on ``device``, or None when it can."""
        device = torch.device(device)
        if self.gpu_only:
            if device.type != "cuda":
                return f"kernel {self.name!r} runs on CUDA GPUs only; the tensors are on {device}"
            major, minor = torch.cuda.get_device_capability(device)
            if major < 8:
                return (f"kernel {self.name!r} needs an Ampere or newer GPU (sm80+); "
                        f"{torch.cuda.get_device_name(device)} is sm{major}{minor}")
            if spec.dtype not in (torch.float16, torch.bfloat16):
                return f"kernel {self.name!r} takes float16 or bfloat16, not {spec.dtype}"
        if spec.dropout_p > 0 and not self.supports_dropout:
            return (f"kernel {self.name!r} has no dropout; use kernel='nvfuser' or 'flash' (or "
                    f"'reference') for dropout_p > 0")
        if spec.window is not None and not self.supports_window:
            return f"kernel {self.name!r} has no sliding window; use kernel={_window_kernels()}"
        if spec.mask is not None and spec.mask.needs_window and not self.supports_window:
            return (f"kernel {self.name!r} has no sliding window, which mask {spec.mask!r} "
                    f"needs (a window or ~); use kernel={_window_kernels()}")
        return self._unavailable_reason(spec, device)

    def _unavailable_reason(self, spec: AttentionSpec, device: torch.device) -> str | None:
        return None

    def too_long(self, rows: int, keys: int, head_dim: int) -> str | None:
        """Why a call of ``rows`` queries and ``keys`` keys per head is past this kernel's
        limits even when split, or None."""
        return too_long(self.name, self.limits, rows, keys, head_dim)

    def check(self, spec: AttentionSpec, device: torch.device) -> None:
        reason = self.unavailable_reason(spec, device)
        if reason is not None:
            raise KernelUnavailable(reason)

    # ---- the contract: calls of any size, split to the limits ------------------------------
    def forward(self, q, k, v, *, causal: bool, scale: float, window: Window | None = None,
                dropout: Dropout | None = None, out=None, lse=None):
        """(out, lse) of q, k, v (written into ``out``, ``lse`` when given)."""
        mask = dict(causal=causal, scale=scale, window=window)
        return pieces.dense_forward(self, q, k, v, mask, dropout, out, lse)

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float,
                 window: Window | None = None, dropout: Dropout | None = None,
                 dq=None, dk=None, dv=None):
        """(dq, dk, dv) given the global out and lse of the rows (written into ``dq``, ``dk``,
        ``dv`` when given)."""
        mask = dict(causal=causal, scale=scale, window=window)
        return pieces.dense_backward(self, dout, q, k, v, out, lse, mask, dropout, (dq, dk, dv))

    def varlen_forward(self, q, k, v, seqlens: Seqlens, *, causal: bool, scale: float,
                       window: Window | None = None, out=None, lse=None):
        """(out [T_q, H, E], lse fp32 [H, T_q]) of packed sequences (written into ``out``,
        ``lse`` when given)."""
        mask = dict(causal=causal, scale=scale, window=window)
        return pieces.packed_forward(self, q, k, v, seqlens, mask, (out, lse))

    def varlen_backward(self, dout, q, k, v, out, lse, seqlens: Seqlens, *, causal: bool,
                        scale: float, window: Window | None = None, dq=None, dk=None, dv=None):
        """(dq, dk, dv) of packed sequences (written into ``dq``, ``dk``, ``dv`` when given)."""
        mask = dict(causal=causal, scale=scale, window=window)
        return pieces.packed_backward(self, dout, q, k, v, out, lse, seqlens, mask,
                                      (dq, dk, dv))

    # ---- what a kernel implements: calls inside its limits -------------------------------
    @abc.abstractmethod
    def _forward(self, q, k, v, *, causal, scale, window, dropout, out, lse):
        """(out, lse) of one call; ``out``/``lse`` are buffers to write into, or None (a kernel
        may also return buffers of its own: they are copied)."""

    @abc.abstractmethod
    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, window, dropout, dq, dk, dv):
        """(dq, dk, dv) of one call; ``dq``/``dk``/``dv`` as ``out`` of ``_forward``."""

    def _varlen_forward(self, q, k, v, seqlens: Seqlens, *, causal, scale, window, out=None,
                        lse=None):
        """One varlen call (``native_varlen``); ``out``/``lse`` as in ``_forward``. This
        default runs the sequences one by one (other rows: out 0, lse -inf)."""
        out = torch.zeros_like(q) if out is None else out.zero_()
        lse = (pieces.packed_lse(q) if lse is None else lse).fill_(-math.inf)
        forward_each(self, q, k, v, _sequences(seqlens), out, lse, causal=causal, scale=scale,
                     window=window)
        return out, lse

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens: Seqlens, *, causal, scale,
                         window, dq=None, dk=None, dv=None):
        grads = tuple(torch.zeros_like(t) if g is None else g.zero_()
                      for t, g in zip((q, k, v), (dq, dk, dv)))
        backward_each(self, dout, q, k, v, out, lse, _sequences(seqlens), grads, causal=causal,
                      scale=scale, window=window)
        return grads

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"


def head_shards(kernel: Kernel, mesh, dim: str) -> Kernel:
    """The kernel for the local head shards of a head split over ``mesh``'s dim ``dim``."""
    return kernel if kernel.split_heads is None else kernel.split_heads(mesh, dim)


def _sequences(seqlens: Seqlens):
    """((query start, stop), (key start, stop)) of every packed sequence."""
    return zip(zip(seqlens.cu_q, seqlens.cu_q[1:]), zip(seqlens.cu_k, seqlens.cu_k[1:]))


def forward_each(kernel: Kernel, q, k, v, spans, out, lse, *, causal, scale, window=None) -> None:
    """``kernel.forward`` on each ((query start, stop), (key start, stop)) of ``spans`` that has
    queries and keys, written into those rows of packed ``out`` and ``lse`` [H, T_q]."""
    for (qa, qb), (ka, kb) in spans:
        if qb == qa or kb == ka:
            continue
        o, l = kernel.forward(_as_dense(q, qa, qb), _as_dense(k, ka, kb), _as_dense(v, ka, kb),
                              causal=causal, scale=scale, window=window,
                              out=_as_dense(out, qa, qb))
        lse[:, qa:qb] = l[0]


def backward_each(kernel: Kernel, dout, q, k, v, out, lse, spans, grads, *, causal, scale,
                  window=None) -> None:
    """``kernel.backward`` on each span of ``spans`` (as ``forward_each``), written into those
    rows of the packed ``grads`` (dq, dk, dv)."""
    for (qa, qb), (ka, kb) in spans:
        if qb == qa or kb == ka:
            continue
        qs, ks = (qa, qb), (ka, kb)
        dq, dk, dv = (_as_dense(grad, *r) for grad, r in zip(grads, (qs, ks, ks)))
        kernel.backward(
            *(_as_dense(t, *r) for t, r in ((dout, qs), (q, qs), (k, ks), (v, ks), (out, qs))),
            lse[:, qa:qb].unsqueeze(0).contiguous(), causal=causal, scale=scale, window=window,
            dq=dq, dk=dk, dv=dv,
        )


def _as_dense(packed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Tokens [start, stop) of a packed [T, H, E] tensor as a BSHE [1, H, s, E] view."""
    return packed[start:stop].unsqueeze(0).transpose(1, 2)


def expand_kv_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeat each K/V head ``groups`` times along dim 1 (GQA -> MHA), keeping the layout."""
    if groups == 1:
        return t
    b, h_kv, s, e = t.shape
    expanded = t.unsqueeze(2).expand(b, h_kv, groups, s, e).reshape(b, h_kv * groups, s, e)
    return like_layout(expanded, t)


def reduce_kv_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradients of repeated K/V heads back onto their K/V head (inverse of expand)."""
    if groups == 1:
        return grad
    b, h, s, e = grad.shape
    reduced = grad.unflatten(1, (h // groups, groups)).sum(2, dtype=torch.float32).to(grad.dtype)
    return like_layout(reduced, grad)


def like_layout(t: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """``t`` with the memory order (BHSE or BSHE) of ``model``."""
    return layout_of(model).to(t)


_REGISTRY: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    """Make ``kernel`` available by its name to ``get`` and ``attention(kernel=...)``."""
    _REGISTRY[kernel.name] = kernel
    return kernel


def _window_kernels() -> str:
    """The registered kernels with sliding windows, as a phrase: 'fa4', 'flash' or 'reference'."""
    quoted = [repr(name) for name, k in sorted(_REGISTRY.items()) if k.supports_window]
    return " or ".join(filter(None, [", ".join(quoted[:-1]), quoted[-1]]))


def names() -> list[str]:
    return sorted(_REGISTRY) + ["auto"]


def get(name: str | Kernel) -> Kernel:
    """The kernel registered as ``name`` (``auto`` is resolved by ``select``)."""
    if isinstance(name, Kernel):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"kernel={name!r} is not known; choose one of {names()}")
    return _REGISTRY[name]
