"""Packed (THD) problems for tests under mpirun: random sequences, the reference
(tests/reference.py) run sequence by sequence on the full tensors, and a schedule's run of
them.

Every rank builds the same full tensors (same seed); the global padding slots of
``cu_seqlens_padded`` hold random values that no result may depend on.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import sdpa_fusion
from tests import reference


@dataclasses.dataclass
class PackedProblem:
    """Full packed q, k, v, dout [T, H, E], their packing, and the reference results (fp64)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor | None
    causal: bool
    scale: float | None
    window: tuple | None = None
    out: torch.Tensor = None
    dq: torch.Tensor = None
    dk: torch.Tensor = None
    dv: torch.Tensor = None


def _cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()],
                        dtype=torch.int32)


def make_packed(lengths, *, h=4, h_kv=None, e=8, slack=None, causal=False, scale=None,
                dtype=torch.float32, device="cpu", seed=0, window=None) -> PackedProblem:
    """Sequences of ``lengths`` tokens; ``slack[i]`` extra padding slots after sequence i
    (given as ``cu_seqlens_padded``) when ``slack`` is not None; ``window`` a sliding window
    (left, right) of every sequence."""
    g = torch.Generator().manual_seed(seed)
    cu = _cumulative(lengths)
    padded = None if slack is None else _cumulative([n + x for n, x in zip(lengths, slack)])
    total = int((cu if padded is None else padded)[-1])

    def rand(heads):
        return torch.randn(total, heads, e, generator=g).to(dtype=dtype, device=device)

    problem = PackedProblem(rand(h), rand(h_kv or h), rand(h_kv or h), rand(h), cu.to(device),
                            None if padded is None else padded.to(device), causal, scale,
                            window)
    want = reference.packed(problem.q, problem.k, problem.v, problem.dout, problem.cu_seqlens,
                            cu_seqlens_padded=problem.cu_seqlens_padded, causal=causal,
                            scale=scale, window=window)
    problem.out, problem.dq, problem.dk, problem.dv = want.results
    return problem


def sequences(problem: PackedProblem):
    """(start, length) of every sequence in the global tensors."""
    cu = problem.cu_seqlens.tolist()
    padded = problem.cu_seqlens_padded
    starts = problem.cu_seqlens if padded is None else padded
    return list(zip(starts.tolist(), [b - a for a, b in zip(cu, cu[1:])]))


def global_positions(problem: PackedProblem) -> torch.Tensor:
    """Position of every global token in its sequence, computed from the packing alone (0 in
    the padding slots)."""
    positions = torch.zeros(problem.q.shape[0], dtype=torch.long)
    for start, n in sequences(problem):
        positions[start:start + n] = torch.arange(n)
    return positions


def run_packed(schedule, problem: PackedProblem, *, kernel="reference", local=False,
               kv_copies=False):
    """Shard, run forward and backward through ``attention`` (with the global cu_seqlens, or
    the LocalPacking when ``local``), unshard: (out, dq, dk, dv) full on every rank. Checks
    that the padding rows of this rank's results are exactly zero. ``kv_copies``: dK and dV
    are unsharded as the sums of their copies (``hybrid`` with K/V heads fewer than its
    inner head_parallel ranks)."""
    cu, padded = problem.cu_seqlens, problem.cu_seqlens_padded
    kw = dict(layout="thd", cu_seqlens=cu, cu_seqlens_padded=padded)
    q, k, v = (schedule.shard(t, **kw).requires_grad_() for t in (problem.q, problem.k, problem.v))
    dout = schedule.shard(problem.dout, **kw)
    packing = schedule.pack(cu, padded) if hasattr(schedule, "pack") else None
    args = dict(cu_seqlens=cu, cu_seqlens_padded=padded)
    if local and packing is not None:
        args = dict(cu_seqlens=packing)
    out = sdpa_fusion.attention(q, k, v, causal=problem.causal, scale=problem.scale, layout="thd",
                                kernel=kernel, schedule=schedule, window=problem.window, **args)
    out.backward(dout)
    results = (out, q.grad, k.grad, v.grad)
    if packing is not None:
        padding = packing.token_index < 0
        for name, t in zip(("out", "dq", "dk", "dv"), results):
            assert not t[padding].any(), f"{name} is not zero on padding tokens"
    copies = dict(heads=problem.k.shape[1], copies="sum") if kv_copies else {}
    return (*(schedule.unshard(t, **kw) for t in results[:2]),
            *(schedule.unshard(t, **kw, **copies) for t in results[2:]))


def assert_packed_matches(problem: PackedProblem, results):
    """Full results equal the reference (zero in the global padding slots) within the
    tolerance of the problem's dtype."""
    expected = (problem.out, problem.dq, problem.dk, problem.dv)
    for name, got, want in zip(("out", "dq", "dk", "dv"), results, expected):
        reference.assert_close(got, want, problem.q.dtype, msg=name)


def refill(offsets: torch.Tensor, array: np.ndarray | None, values: list[int]) -> None:
    """Write ``values`` into the cu_seqlens buffer as a data loader reusing its buffers does:
    into the NumPy ``array`` it shares memory with, else through ``.data``; neither bumps
    the tensor's version."""
    version = offsets._version
    if array is not None:
        array[:] = values
    else:
        offsets.data.copy_(torch.tensor(values))
    assert offsets._version == version and offsets.tolist() == values


def assert_round_trip(sched, problem: PackedProblem) -> None:
    """unshard(shard(x)) under ``sched`` is x (zero in the global padding slots), and the
    gradient of the full result reaches the tokens this rank holds only."""
    kw = dict(layout="thd", cu_seqlens=problem.cu_seqlens,
              cu_seqlens_padded=problem.cu_seqlens_padded)
    x = problem.q.clone().requires_grad_()
    back = sched.unshard(sched.shard(x, **kw), **kw)
    real = torch.zeros(x.shape[0], dtype=torch.bool)
    for start, n in sequences(problem):
        real[start:start + n] = True
    torch.testing.assert_close(back, torch.where(real[:, None, None], problem.q, 0.0))
    (back * problem.dout).sum().backward()
    index = sched.pack(problem.cu_seqlens, problem.cu_seqlens_padded).token_index
    mine = torch.zeros_like(real)
    mine[index[index >= 0]] = True
    torch.testing.assert_close(x.grad, torch.where(mine[:, None, None], problem.dout, 0.0))
