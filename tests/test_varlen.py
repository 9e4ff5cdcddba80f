"""Packed (varlen) attention on CPU: every kernel and way that runs here against torch SDPA
run sequence by sequence, and the pure pieces of the GPU paths (flash's mask conversion, the
padding plan, the cost model).

Run: pytest -q tests/test_varlen.py
Reference: tests/reference.py's ``packed``, torch SDPA with autograd in fp64 on each sequence;
random lengths (hypothesis) include 0, 1 and queries != keys per sequence (top-left masks).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import sdpa_fusion
from sdpa_fusion import AttentionSpec
from sdpa_fusion.kernels import KernelUnavailable, Padded, PerSequence, Seqlens, Split, Varlen, get
from sdpa_fusion.kernels import choice, cost, packed
from sdpa_fusion.kernels.aten import _dense_window
from sdpa_fusion.kernels.flash_window import flash_call, flash_cut
from sdpa_fusion.local import packed_seqlens
from sdpa_fusion.mask import Window, band
from tests import reference
from tests.reference import assert_close

H, E, SCALE = 4, 16, 0.3
length = st.one_of(st.integers(0, 2), st.integers(0, 20), st.just(41))
side = st.one_of(st.none(), st.integers(0, 6))
windows = st.one_of(st.none(), st.tuples(side, side))


def cumulative(lengths) -> tuple[int, ...]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def packed_inputs(seqlens: Seqlens, kv_heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seqlens.cu_q[-1], H, E, generator=g)
    k, v = (torch.randn(seqlens.cu_k[-1], kv_heads, E, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    return q, k, v, dout


def run_varlen(kernel, q, k, v, dout, seqlens, causal, window):
    window = Window.of(window)
    out, lse = kernel.varlen_forward(q, k, v, seqlens, causal=causal, scale=SCALE, window=window)
    grads = kernel.varlen_backward(dout, q, k, v, out, lse, seqlens, causal=causal, scale=SCALE,
                                   window=window)
    return out, lse, *grads


def check_per_sequence(got, q, k, v, dout, seqlens, causal, window):
    """Each sequence of the packed results against the reference on that sequence alone."""
    out, lse, dq, dk, dv = got
    assert out.shape == q.shape and lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32
    for (qa, qb), (ka, kb) in zip(zip(seqlens.cu_q, seqlens.cu_q[1:]),
                                  zip(seqlens.cu_k, seqlens.cu_k[1:])):
        if qb == qa or kb == ka:  # no keys (or no queries): out 0, lse -inf, gradients 0
            assert out[qa:qb].abs().sum() == 0 and dq[qa:qb].abs().sum() == 0
            assert torch.all(lse[:, qa:qb] == -math.inf)
            assert dk[ka:kb].abs().sum() == 0 and dv[ka:kb].abs().sum() == 0
    want = reference.packed(q, k, v, dout, seqlens.cu_q, cu_seqlens_k=seqlens.cu_k,
                            causal=causal, scale=SCALE, window=window)
    seen = torch.isfinite(want.lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key: lse -inf"
    assert_close(lse[seen], want.lse[seen], msg="lse")
    reference.assert_results((out, dq, dk, dv), want)


# ---- the reference kernel (and the per-sequence way) ------------------------------------------
@settings(max_examples=25)
@given(pairs=st.lists(st.tuples(length, length), min_size=1, max_size=5), causal=st.booleans(),
       window=windows, kv_heads=st.sampled_from([4, 2, 1]), seed=st.integers(0, 99))
def test_reference_varlen_matches_torch_per_sequence(pairs, causal, window, kv_heads, seed):
    seqlens = Seqlens(cumulative(n for n, _ in pairs), cumulative(m for _, m in pairs))
    q, k, v, dout = packed_inputs(seqlens, kv_heads, seed)
    for kernel in (get("reference"), PerSequence("reference")):
        got = run_varlen(kernel, q, k, v, dout, seqlens, causal, window)
        check_per_sequence(got, q, k, v, dout, seqlens, causal, window)


# ---- the padded way (one dense call), run here on the reference kernel -------------------------
@settings(max_examples=25)
@given(lengths=st.lists(length, min_size=1, max_size=5), left=side, kv_heads=st.sampled_from([4, 2]),
       seed=st.integers(0, 99))
def test_padded_way_matches_torch_per_sequence(lengths, left, kv_heads, seed):
    """Causal (window right side 0): padding keys after each sequence stay hidden."""
    window = None if left is None else (left, 0)
    seqlens = packed_seqlens(cumulative(lengths))
    q, k, v, dout = packed_inputs(seqlens, kv_heads, seed)
    got = run_varlen(Padded("reference"), q, k, v, dout, seqlens, True, window)
    check_per_sequence(got, q, k, v, dout, seqlens, True, window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_way_without_copies_when_sequences_share_one_length(causal):
    seqlens = packed_seqlens(cumulative([6, 6, 6]))
    plan = packed.padding(seqlens, 18, 18, band(causal, None), torch.device("cpu"))
    assert plan.slots["q"] is None and (plan.count, plan.length) == (3, {"q": 6, "k": 6})
    q, k, v, dout = packed_inputs(seqlens, 2, 0)
    got = run_varlen(Padded("reference"), q, k, v, dout, seqlens, causal, None)
    check_per_sequence(got, q, k, v, dout, seqlens, causal, None)


def test_padded_way_refuses_what_padding_would_get_wrong():
    seqlens = packed_seqlens(cumulative([3, 5]))
    q, k, v, _ = packed_inputs(seqlens, 4, 0)
    with pytest.raises(KernelUnavailable, match="padding keys would be attended"):
        sdpa_fusion.attention(q, k, v, layout="thd", cu_seqlens=[0, 3, 8],
                              kernel=Padded("reference"))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cu_k", [(0, 5, 10, 15), (0, 5, 7, 12)], ids=["one-shape", "uneven"])
def test_padded_way_runs_the_calls_of_a_schedule(causal, cu_k):
    """Calls with other shapes than the problem's (a ring block: 3 queries, 5 keys each) pad
    to one dense call when they share one shape, else go through the kernel's varlen call."""
    seqlens = Seqlens((0, 3, 6, 9), cu_k)
    q, k, v, dout = packed_inputs(seqlens, 2, 0)
    one_shape = packed.padding(seqlens, 9, 15, band(causal, None), torch.device("cpu"))
    assert (one_shape is not None) == (cu_k == (0, 5, 10, 15))
    got = run_varlen(Padded("reference"), q, k, v, dout, seqlens, causal, None)
    check_per_sequence(got, q, k, v, dout, seqlens, causal, None)


# ---- the split way: long sequences one by one, short ones in one varlen call --------------------
@settings(max_examples=20)
@given(pairs=st.lists(st.tuples(length, length), min_size=1, max_size=6), causal=st.booleans(),
       window=windows, min_long=st.integers(1, 30), seed=st.integers(0, 99))
def test_split_way_matches_torch_per_sequence(pairs, causal, window, min_long, seed):
    seqlens = Seqlens(cumulative(n for n, _ in pairs), cumulative(m for _, m in pairs))
    q, k, v, dout = packed_inputs(seqlens, 2, seed)
    got = run_varlen(Split("reference", "reference", min_long), q, k, v, dout, seqlens, causal,
                     window)
    check_per_sequence(got, q, k, v, dout, seqlens, causal, window)


# ---- output buffers: every way writes its whole result into the buffers it is given ------------
WAYS = {"reference": lambda: get("reference"), "per-sequence": lambda: PerSequence("reference"),
        "padded": lambda: Padded("reference"), "split": lambda: Split("reference", "reference", 5)}


@settings(max_examples=25)
@given(pairs=st.lists(st.tuples(length, length), min_size=1, max_size=4),
       same=st.booleans(), causal=st.booleans(), seed=st.integers(0, 99))
@example(pairs=[(41, 41), (1, 0)], same=False, causal=False, seed=0)  # a row past the padding
@pytest.mark.parametrize("way", list(WAYS))
def test_varlen_writes_into_given_buffers(way, pairs, same, causal, seed):
    """Buffers filled with NaN come back holding exactly the results of a call without them
    (rows of sequences without keys or queries included), right per sequence, and are what
    the call returns."""
    if same:  # one shape: the padded way's dense view of the buffers
        pairs = [pairs[0]] * len(pairs)
    seqlens = Seqlens(cumulative(n for n, _ in pairs), cumulative(m for _, m in pairs))
    q, k, v, dout = packed_inputs(seqlens, 2, seed)
    kernel, mask = WAYS[way](), dict(causal=causal, scale=SCALE)
    want = run_varlen(kernel, q, k, v, dout, seqlens, causal, None)
    out, dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, q, k, v))
    lse = torch.full((H, q.shape[0]), math.nan)
    got = kernel.varlen_forward(q, k, v, seqlens, **mask, out=out, lse=lse)
    got += kernel.varlen_backward(dout, q, k, v, want[0], want[1], seqlens, **mask, dq=dq, dk=dk,
                                  dv=dv)
    for name, result, buffer, expected in zip(("out", "lse", "dq", "dk", "dv"), got,
                                              (out, lse, dq, dk, dv), want):
        assert result.data_ptr() == buffer.data_ptr(), f"{name}: the given buffer is returned"
        assert torch.equal(buffer, expected), f"{name} differs from a call without buffers"
    check_per_sequence((out, lse, dq, dk, dv), q, k, v, dout, seqlens, causal, None)


def test_split_sequences_cuts_long_ones_into_pieces_of_a_tile_or_the_longest_short_one():
    short, long = packed.split_sequences(packed_seqlens((0, 10, 13, 15, 45)), 10)
    assert long == (((0, 10), (0, 10)), ((15, 45), (15, 45)))
    # the long ones: queries without keys, keys without queries, each in one piece of a tile
    assert list(short.lengths_q) == [10, 0, 3, 2, 30, 0]
    assert list(short.lengths_k) == [0, 10, 3, 2, 0, 30]
    assert short.cu_q[-1] == short.cu_k[-1] == 45
    short, _ = packed.split_sequences(packed_seqlens((0, 300, 600, 800)), 250)
    assert list(short.lengths_q) == [200, 100, 0, 0] * 2 + [200]  # pieces of the 200-token one
    # only long sequences: pieces of one tile, not one sequence per token
    short, long = packed.split_sequences(packed_seqlens((0, 1000)), 10)
    assert long == (((0, 1000), (0, 1000)),)
    assert list(short.lengths_q) == [128] * 7 + [104] + [0] * 8
    assert list(short.lengths_k) == [0] * 8 + [128] * 7 + [104]


# ---- attention(layout="thd") end to end ----------------------------------------------------------
@settings(max_examples=15)
@given(lengths=st.lists(length, min_size=1, max_size=4), extra=st.lists(st.integers(0, 5), min_size=4,
       max_size=4), causal=st.booleans(), window=windows, seed=st.integers(0, 99))
def test_thd_with_padding_window_and_gqa(lengths, extra, causal, window, seed):
    """Real tokens exact; padding tokens get output 0 and gradient 0 and are never attended."""
    room = [n + p for n, p in zip(lengths, extra)]
    starts = cumulative(room)
    total = starts[-1]
    assume(total > 0)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, H, E, generator=g, requires_grad=True)
    k, v = (torch.randn(total, 2, E, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(total, H, E, generator=g)
    out = sdpa_fusion.attention(q, k, v, layout="thd", causal=causal, scale=SCALE, window=window,
                                cu_seqlens=list(cumulative(lengths)), cu_seqlens_padded=torch.tensor(starts))
    out.backward(dout)
    real = torch.zeros(total, dtype=torch.bool)
    for start, n in zip(starts, lengths):
        real[start:start + n] = True
    want = reference.packed(q, k, v, dout, cumulative(lengths), cu_seqlens_padded=starts,
                            causal=causal, scale=SCALE, window=window)
    reference.assert_results((out, q.grad, k.grad, v.grad), want)
    for name, t in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad)):
        assert t[~real].abs().sum() == 0, f"{name} is 0 on padding tokens"


def test_packed_seqlens_gives_padding_sequences_of_its_own():
    seqlens = packed_seqlens((0, 5, 6, 20), (0, 8, 10, 24))
    # sequence, padding queries (no keys), padding keys (no queries), for each padded slot
    assert list(seqlens.lengths_q) == [5, 3, 0, 1, 1, 0, 14]
    assert list(seqlens.lengths_k) == [5, 0, 3, 1, 0, 1, 14]
    assert packed_seqlens((0, 4, 9)) == Seqlens((0, 4, 9), (0, 4, 9))


# ---- flash: the top-left band as flash's bottom-right window (pure, checked exhaustively) ------
def flash_sees(n_q, n_k, causal, left, right, max_k):
    """What flash computes on one block: its argument handling (flash_api.cpp: causal sets the
    right window to 0; a window >= the max key length becomes -1; an unbounded side next to a
    bounded one becomes the max key length), then its bottom-right mask."""
    if causal:
        right = 0
    left, right = (-1 if w >= max_k else w for w in (left, right))
    if left < 0 <= right:
        left = max_k
    elif right < 0 <= left:
        right = max_k
    i = torch.arange(n_q)[:, None] + (n_k - n_q)
    j = torch.arange(n_k)[None, :]
    seen = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    return seen


BANDS = [(None, None), (None, 0), (2, 0), (0, 0), (3, 1), (None, 2), (1, None), (0, None),
         (50, None)]


@pytest.mark.parametrize("mask", BANDS, ids=str)
def test_flash_dense_call_is_the_top_left_band_or_goes_through_varlen(mask):
    for n_q in range(1, 9):
        for n_k in range(1, 9):
            q, k = torch.empty(1, 1, n_q, 8), torch.empty(1, 1, n_k, 8)
            rows, keys, win = _dense_window(q, k, False, Window(*mask))
            if win is None:  # the varlen call of the same block, checked below
                assert rows > keys and flash_call(Seqlens((0, n_q), (0, n_k)), n_q, n_k, mask)
                continue
            got = torch.zeros(n_q, n_k, dtype=torch.bool)
            if rows:
                got[:rows, :keys] = flash_sees(rows, keys, win.causal, win.left, win.right, keys)
            assert torch.equal(got, sdpa_fusion.mask.visible(n_q, n_k, mask)), (n_q, n_k)


@settings(max_examples=60)
@given(pairs=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=4),
       mask=st.sampled_from(BANDS), lead=st.integers(0, 2), tail=st.integers(0, 2))
def test_flash_call_covers_every_token_with_the_top_left_band(pairs, mask, lead, tail):
    seqlens = Seqlens(tuple(lead + c for c in cumulative(n for n, _ in pairs)),
                      tuple(lead + c for c in cumulative(m for _, m in pairs)))
    t_q, t_k = seqlens.cu_q[-1] + tail, seqlens.cu_k[-1] + tail
    call = flash_call(seqlens, t_q, t_k, mask)
    want = torch.zeros(t_q, t_k, dtype=torch.bool)
    for (qa, qb), (ka, kb) in zip(zip(seqlens.cu_q, seqlens.cu_q[1:]),
                                  zip(seqlens.cu_k, seqlens.cu_k[1:])):
        want[qa:qb, ka:kb] = sdpa_fusion.mask.visible(qb - qa, kb - ka, mask)
    if call is None:  # only when masked sequences have different shifts
        cuts = [flash_cut(n, m, mask) for n, m in pairs]
        assert mask != (None, None) and len({k - r for r, k in cuts if r}) > 1
        return
    assert call.seqlens.cu_q[-1] == t_q and call.seqlens.cu_k[-1] == t_k
    assert call.max_q >= 2 and call.max_k >= call.seqlens.max_k
    got = torch.zeros(t_q, t_k, dtype=torch.bool)
    cu, w = call.seqlens, call.window
    for (qa, qb), (ka, kb) in zip(zip(cu.cu_q, cu.cu_q[1:]), zip(cu.cu_k, cu.cu_k[1:])):
        got[qa:qb, ka:kb] = flash_sees(qb - qa, kb - ka, w.causal, w.left, w.right, call.max_k)
    assert torch.equal(got, want)


def test_flash_call_of_self_attention_is_one_call():
    seqlens = packed_seqlens((0, 128, 300, 301))
    call = flash_call(seqlens, 301, 301, (None, 0))
    assert call.seqlens == seqlens and call.window.causal and call.max_k == 172
    assert flash_call(seqlens, 301, 301, (64, 0)).window.left == 64


# ---- the cost model ----------------------------------------------------------------------------
def thd_spec(lengths, causal=True, window=None):
    total = sum(lengths)
    return AttentionSpec(batch=1, heads=32, kv_heads=32, q_len=total, kv_len=total, head_dim=128,
                         causal=causal, layout="thd", cu_seqlens=cumulative(lengths), window=window)


BATCH_A = [1024, 2048, 4096, 8192, 16384, 32768, 32768, 24576, 16384, 8192, 4096, 2048, 1024,
           32768, 32768]


MIX = [32768] * 2 + [8192] * 4 + [2048] * 8 + [128] * 1024


@pytest.mark.parametrize("lengths, order", [
    (BATCH_A, ["cudnn per-sequence", "flash varlen", "cudnn padded"]),
    ([128] * 2048, ["cudnn padded", "flash varlen", "cudnn per-sequence"]),
    (MIX, ["flash varlen", "cudnn per-sequence", "cudnn padded"]),
], ids=["a-15-long", "b-2048x128", "mix"])
def test_cost_model_orders_the_ways_as_measured(lengths, order):
    """Measured on an H200 (benchmarks/thd.py): a 536/329/246, b 79/66/1.3, mix 245/148/oom
    TFLOP/s for the three ways in ``order``."""
    spec = thd_spec(lengths)
    ways = {w.name: w for w in (Varlen("flash"), PerSequence("cudnn"), Padded("cudnn"))}
    assert sorted(order, key=lambda name: ways[name].estimate(spec)) == order


def test_cost_model_splits_a_mix_of_long_and_short_documents():
    spec = thd_spec(MIX)
    split = choice.best_split(spec, "cudnn", "flash")
    assert split.name == "cudnn per-sequence from 2048 tokens + flash varlen"
    assert split.estimate(spec) < 0.75 * min(w.estimate(spec) for w in (
        Varlen("flash"), PerSequence("cudnn"), Padded("cudnn")))
    assert choice.best_split(thd_spec([128] * 20), "cudnn", "flash") is None


def test_cost_model_counts_host_time_per_call_and_flops_per_sequence():
    spec = thd_spec([128] * 10)
    one = cost.speed(get("cudnn"), "dense")
    assert PerSequence("cudnn").estimate(spec) == pytest.approx(10 * one.host_s)
    assert Padded("cudnn").estimate(thd_spec([8, 9], causal=False)) == math.inf


@pytest.mark.parametrize("lengths, chosen", [
    ([128] * 2048, "fa4 padded"),        # thd.json batch b: padded 64-72 TFLOP/s, varlen 30-32
    ([1024 * (1 + i % 32) for i in range(15)], "fa4 varlen"),  # long documents: varlen 602-608
])
def test_choose_with_fa4_takes_the_way_measured_fastest(monkeypatch, lengths, chosen):
    """2048 short documents cost more in one varlen call (per sequence and head) than
    padded into one dense call."""
    for name in ("cudnn", "flash", "fa4"):
        monkeypatch.setattr(get(name), "unavailable_reason", lambda spec, device: None)
    way, _ = choice.choose(thd_spec(lengths), "cpu", (max(lengths), max(lengths)))
    assert way.name == chosen


def test_varlen_estimate_counts_each_sequence_and_head():
    s = cost.speed(get("fa4"), "varlen")
    spec = thd_spec([128] * 64)
    assert Varlen("fa4").estimate(spec) == pytest.approx(
        s.host_s + sum(s.seconds(f, n) for n, f in cost.sequence_work(spec))
        + 64 * 32 * s.sequence_s)
    assert s.sequence_s > 0


def test_choose_explains_every_estimate(monkeypatch):
    """On a GPU ``auto`` runs this; here the GPU kernels are declared available."""
    for name in ("cudnn", "flash"):
        monkeypatch.setattr(get(name), "unavailable_reason", lambda spec, device: None)
    way, notes = choice.choose(thd_spec([128] * 2048), "cpu", (128, 128))
    assert way.name == "cudnn padded" and isinstance(way, Padded)
    assert notes[0].startswith("auto chose cudnn padded for these packed sequences: ")
    assert any(n.startswith("flash varlen: estimated") for n in notes[1:])
    # flash padded, flash varlen, cudnn/flash per-sequence; then why kernels were left out (fa4)
    assert [n.split(":")[0] for n in notes[1:] if "estimated" in n] == [
        "flash padded", "flash varlen", "cudnn per-sequence", "flash per-sequence"]
    assert all(n.startswith("kernel 'fa4'") for n in notes[1:] if "estimated" not in n)


def test_choose_pays_host_time_once_per_call_of_a_schedule(monkeypatch):
    """A ring makes one call per step on a rank's cut documents: a split that runs them
    one by one pays the host time of every dense call at every step (batch c at four
    ranks: the split ran 61-68 ms a rank where FA4's varlen ran 39-40)."""
    for name in ("cudnn", "flash", "fa4"):
        monkeypatch.setattr(get(name), "unavailable_reason", lambda spec, device: None)
    spec = thd_spec([64] * 3000 + [4096] * 6)
    once, _ = choice.choose(spec, "cpu", (4096, 4096))
    ring, _ = choice.choose(spec, "cpu", (4096, 4096), calls=4)
    assert isinstance(once, Split) and ring.name == "fa4 varlen"
