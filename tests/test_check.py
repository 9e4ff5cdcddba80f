"""benchmarks.check against the test reference (tests/reference.py: torch SDPA in fp64 with
autograd): right steps pass, wrong ones are caught (BHSE and BSHE, GQA, causal and not, packed, shards of regenerated inputs).

Run: python -m pytest -q tests/test_check.py
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import check
from benchmarks.check import Generated, Problem, check_packed, check_shard, merge
from tests import reference

FP32 = check.TOLERANCE[torch.float32]


def inputs(b, h, h_kv, s, e, layout="bhse", dtype=torch.float32, seed=0):
    """q, k, v, dout of logical [B, H, S, E] (k, v with h_kv heads) in ``layout``."""
    g = torch.Generator().manual_seed(seed)

    def one(heads):
        if layout == "bshe":
            return torch.randn(b, s, heads, e, generator=g, dtype=dtype).transpose(1, 2)
        return torch.randn(b, heads, s, e, generator=g, dtype=dtype)

    return one(h), one(h_kv), one(h_kv), one(h)


def step(q, k, v, dout, causal, dtype=torch.float32, scale=None):
    """A right step's results in ``dtype``: the reference's, rounded."""
    want = reference.attention(q, k, v, dout, causal=causal, scale=scale)
    return [t.to(dtype) for t in want.results]


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_a_right_step_passes_with_fp32_errors(layout, causal, kv_heads):
    q, k, v, dout = inputs(2, 4, kv_heads, 80, 16, layout)
    report = check.check(q, k, v, dout, *step(q, k, v, dout, causal), causal=causal)
    assert report.right, check.line(report.as_dict())
    assert max(report.errors.values()) < 1e-5
    assert report.query_rows[0] == 0 and report.query_rows[-1] == 79
    # causal: row 0 meets one key and key 79 one query: too few terms for a relative error
    assert report.rows == {"out": 16, "dq": 16 - causal, "dk": 8 - causal, "dv": 8}
    assert {w[0] for w in report.worst.values()} <= {0, 1}  # batch elements first and last


def test_bf16_results_pass_against_their_own_rounding():
    q, k, v, dout = (t.bfloat16() for t in inputs(1, 4, 2, 256, 32, "bshe"))
    results = step(q, k, v, dout, True, torch.bfloat16, scale=0.3)
    report = check.check(q, k, v, dout, *results, causal=True, scale=0.3)
    assert report.tolerance == check.TOLERANCE[torch.bfloat16]
    assert report.right and max(report.errors.values()) < 1e-2, check.line(report.as_dict())


def test_chunks_of_keys_heads_and_rows_give_the_same_reference(monkeypatch):
    monkeypatch.setattr(check, "KEYS_PER_STEP", 7)
    monkeypatch.setattr(check, "HEADS_PER_STEP", 1)
    monkeypatch.setattr(check, "ROWS_PER_STEP", 5)
    monkeypatch.setattr(check, "KEY_TAIL", 30)
    q, k, v, dout = inputs(1, 4, 2, 96, 8, "bshe")
    report = check.check(q, k, v, dout, *step(q, k, v, dout, True), causal=True, rows=12)
    assert report.right and max(report.errors.values()) < 1e-5, check.line(report.as_dict())
    assert min(report.key_rows) >= 96 - 30


def test_keys_nearer_the_end_when_the_key_reference_would_cost_too_much():
    q, k, v, dout = inputs(1, 2, 2, 128, 8)
    results = step(q, k, v, dout, True)
    wide = check.check(q, k, v, dout, *results, causal=True)
    assert min(wide.key_rows) == 0 and not wide.notes  # KEY_TAIL 512 covers all 128
    # the last 8 keys are seen by 8 queries of at most 128 keys: 1024 pairs of 4*2*8 FLOP
    near = check.check(q, k, v, dout, *results, causal=True, key_flops=1024 * 64)
    assert min(near.key_rows) >= 120 and near.rows["dk"] > 0 and near.right


def test_without_a_mask_dk_and_dv_past_the_budget_are_not_checked_and_say_so():
    q, k, v, dout = inputs(1, 2, 2, 64, 8)
    results = step(q, k, v, dout, False)
    report = check.check(q, k, v, dout, *results, causal=False, key_flops=1e3)
    assert report.errors["dk"] is None and report.rows["dv"] == 0 and report.right
    assert report.notes and report.notes[0].startswith("dk, dv not checked")
    assert merge([report.as_dict()])["notes"] == report.notes


@pytest.mark.parametrize("name", ["dq", "dk", "dv", "out"])
def test_a_wrong_row_is_caught_where_it_is(name):
    q, k, v, dout = inputs(2, 4, 2, 64, 16, "bshe")
    results = dict(zip(check.NAMES, step(q, k, v, dout, True)))
    wrong = results[name]
    row = 54 if name == "dk" else 63  # key 63 meets one query: too few terms to compare
    wrong[1, 1, row] += 0.5 * wrong[1, 1, row].norm() / 16 ** 0.5  # last batch, head 1
    report = check.check(q, k, v, dout, *results.values(), causal=True)
    assert not report.right
    assert report.errors[name] > 0.3
    assert report.worst[name] == [1, 1, row]
    assert all(e < 1e-5 for n, e in report.errors.items() if n != name)


@pytest.mark.parametrize("name", ["dq", "dk"])
def test_a_sample_of_heads_checks_those_heads_and_names_them(name):
    """``heads=2`` of 4 K/V heads (8 query heads, GQA): K/V heads 0 and 3, query heads 0, 1,
    6, 7. A wrong row of a sampled head is caught and named by its head in the step; one of
    a head left out is not seen."""
    q, k, v, dout = inputs(1, 8, 4, 48, 16, "bhse")
    results = dict(zip(check.NAMES, step(q, k, v, dout, True)))
    right = check.check(q, k, v, dout, *results.values(), causal=True, heads=2)
    assert right.right and max(right.errors.values()) < 1e-5, check.line(right.as_dict())
    head, missed, row = (7, 3, 41) if name == "dq" else (3, 2, 40)  # a sampled row each
    wrong = results[name]
    wrong[0, missed, row] += 1.0  # a head the sample leaves out
    assert check.check(q, k, v, dout, *results.values(), causal=True, heads=2).right
    wrong[0, head, row] += 0.5 * wrong[0, head, row].norm() / 4
    report = check.check(q, k, v, dout, *results.values(), causal=True, heads=2)
    assert not report.right and report.worst[name] == [0, head, row], report.worst


def test_rows_of_a_few_terms_are_left_out_of_dq_and_dk():
    """bf16 rounding of a sum of a few terms of both signs is no error of the step: a wrong
    value there is not counted, one row further in is."""
    q, k, v, dout = inputs(1, 2, 2, 64, 8)
    out, dq, dk, dv = step(q, k, v, dout, True)
    dk[0, 0, 63] *= 2  # key 63 meets one query
    dq[0, 0, 0] *= 2  # row 0 meets one key
    report = check.check(q, k, v, dout, out, dq, dk, dv, causal=True)
    assert report.right and 63 in report.key_rows and 0 in report.query_rows
    dk[0, 0, 54] *= 2  # ten queries
    assert not check.check(q, k, v, dout, out, dq, dk, dv, causal=True).right


def test_nan_is_wrong():
    q, k, v, dout = inputs(1, 2, 2, 32, 8)
    out, dq, dk, dv = step(q, k, v, dout, True)
    dq[0, 0, 31, 0] = float("nan")
    report = check.check(q, k, v, dout, out, dq, dk, dv, causal=True)
    assert not report.right and report.worst["dq"] == [0, 0, 31]


def packed(lengths, h, h_kv, e, causal):
    """Packed inputs and per-sequence reference results (rounded to fp32), and cu_seqlens."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, dout = (t[0].transpose(0, 1).contiguous()
                     for t in inputs(1, h, h_kv, int(cu[-1]), e))  # [T, H, E]
    want = reference.packed(q, k, v, dout, cu, causal=causal)
    return (q, k, v, dout), [t.float() for t in want.results], cu


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_sequences_are_masked_apart(causal):
    (q, k, v, dout), results, cu = packed([5, 40, 1, 3, 30], 4, 2, 8, causal)
    report = check_packed(q, k, v, dout, *results, cu, causal=causal, rows=20)
    assert report.right and max(report.errors.values()) < 1e-5, check.line(report.as_dict())
    assert 40 not in report.key_rows  # the one-token sequence (dK 0) is not a key checked
    out, dq, dk, dv = results
    dq[44] *= 1.5  # the last token of the second sequence; every row is sampled below
    wrong = check_packed(q, k, v, dout, out, dq, dk, dv, cu, causal=causal, rows=79)
    assert not wrong.right and wrong.worst["dq"][2] == 44


def test_a_packed_step_checked_as_one_sequence_is_wrong():
    (q, k, v, dout), results, cu = packed([20, 20], 2, 2, 8, True)
    assert not check_packed(q, k, v, dout, *results, [0, 40], causal=True).right


def test_generated_rows_are_the_same_however_they_are_asked_for():
    g = Generated(3, 8, dtype=torch.bfloat16, device="cpu", seed=5, index=2, chunk=16)
    full = g(torch.arange(100))
    rows = torch.tensor([99, 3, 50, 16, 15])
    assert torch.equal(g(rows), full[:, :, rows])
    shard = g.into(torch.empty(1, 100, 3, 8, dtype=torch.bfloat16).transpose(1, 2),
                   torch.arange(100))
    assert torch.equal(shard, full)
    other = Generated(3, 8, dtype=torch.bfloat16, device="cpu", seed=5, index=3, chunk=16)
    assert not torch.equal(other(rows), g(rows))


def load_balanced(s, ranks, rank):
    c = s // (2 * ranks)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * ranks - 1 - rank) * c, (2 * ranks - rank) * c)])


def test_each_rank_checks_its_shard_against_the_regenerated_problem(monkeypatch):
    monkeypatch.setattr(check, "KEY_TAIL", 16)  # rank 0 holds the last 32 tokens, rank 1 none
    s, h, e = 128, 4, 8
    makers = [Generated(h, e, dtype=torch.float32, device="cpu", seed=1, index=i, chunk=16)
              for i in range(4)]
    problem = Problem(*makers, seq_len=s, causal=True, scale=e ** -0.5)
    full = step(*(m(torch.arange(s)) for m in makers), True)
    reports = []
    for rank in range(2):
        positions = load_balanced(s, 2, rank)
        mine = [t[:, :, positions] for t in full]
        if rank == 1:
            mine[1][0, 2, -1] *= 2  # dq of its last slot: position 95
        reports.append(check_shard(problem, positions, *mine).as_dict())
    assert reports[0]["right"] and reports[0]["rows"]["dk"] > 0  # rank 0 holds the tail
    assert reports[1]["rows"]["dk"] == 0 and reports[1]["errors"]["dk"] is None
    assert not reports[1]["right"] and reports[1]["worst"]["dq"] == [0, 2, 95]
    merged = merge(reports)
    assert not merged["right"] and merged["worst"]["dq"] == [0, 2, 95]
    assert merged["rows"]["out"] == 32 and merged["errors"]["dk"] is not None
    assert merge(reports[:1])["right"]


def test_a_step_whose_check_found_a_wrong_row_is_no_figure():
    from benchmarks.common import Measurement

    timed = Measurement(median_ms=1.0, min_ms=1.0, max_ms=1.0)
    wrong = {"right": False, "errors": {"dq": 0.4}, "tolerance": 0.05}
    assert check.judged(timed, {"right": True}) is timed
    judged = check.judged(timed, wrong)
    assert (judged.status, judged.median_ms) == ("wrong", None)
    assert judged.error == check.line(wrong)
