"""Dropout on one device: the reference kernel's seeded masks against the explicit formula,
and the streams schedules give their ranks and blocks.

Under schedules: tests/distributed/test_dropout.py. On GPUs: tests/gpu/test_nvfuser_kernel.py.
"""

from __future__ import annotations

import pytest
import torch

import sdpa_fusion
from sdpa_fusion.kernels import Dropout, get
from tests import reference

P_DROP = 0.3


def test_reference_dropout_is_the_explicit_formula(rng):
    """out = (softmax * M / (1 - p)) v with M drawn from a generator seeded with the stream's
    seed, and the gradients of that formula (the test reference with that keep-mask, fp64
    autograd): the backward replays the forward's mask. GQA: 4 query heads over 2 K/V
    heads."""
    q, dout = (torch.randn(2, 4, 12, 8, generator=rng) for _ in range(2))
    k, v = (torch.randn(2, 2, 12, 8, generator=rng) for _ in range(2))
    dropout = Dropout(P_DROP, seed=1234)
    ref = get("reference")
    out, lse = ref.forward(q, k, v, causal=True, scale=0.3, dropout=dropout)
    grads = ref.backward(dout, q, k, v, out, lse, causal=True, scale=0.3, dropout=dropout)

    keep = torch.rand((2, 4, 12, 12), generator=torch.Generator().manual_seed(1234)) >= P_DROP
    want = reference.attention(q, k, v, dout, causal=True, scale=0.3, dropout=(keep, P_DROP))
    reference.assert_results((out, *grads), want)


def test_attention_dropout_is_seeded_by_torch(rng):
    """attention(dropout_p=) draws its stream from torch's generator: the same seed gives the
    same output, another seed another one; dropout_p=0 is plain attention."""
    q, k, v = (torch.randn(1, 2, 16, 8, generator=rng) for _ in range(3))

    def run(seed, p=P_DROP):
        torch.manual_seed(seed)
        return sdpa_fusion.attention(q, k, v, causal=True, dropout_p=p)

    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))
    torch.testing.assert_close(run(1, 0.0), sdpa_fusion.attention(q, k, v, causal=True))


def test_streams_are_per_key_and_kept_for_the_backward():
    call = Dropout(P_DROP, seed=99)
    block = call.stream("ring", 0, 1)
    assert call.stream("ring", 0, 1) is block  # the same object: its state serves the backward
    seeds = {call.stream("ring", r, j).seed for r in range(4) for j in range(4)}
    assert len(seeds) == 16 and call.seed not in seeds
    assert Dropout(P_DROP, seed=99).stream("ring", 0, 1).seed == block.seed  # reproducible
    assert Dropout(P_DROP, seed=98).stream("ring", 0, 1).seed != block.seed


def test_dropout_with_packed_sequences_is_refused():
    q = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match=r"dropout_p=0.3 is not supported with layout='thd'"):
        sdpa_fusion.attention(q, q, q, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32),
                              dropout_p=P_DROP)
