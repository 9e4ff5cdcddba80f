"""The pieces of the agreement rule that need no ranks: canonical text, fingerprints, the
verdict every rank raises, schedule options and configurations.
Run: pytest -q tests/test_agreement.py
"""

from __future__ import annotations

import datetime

import pytest
import torch

import schedules
from schedules.partition import IndexMap, LoadBalanced
from sdpa_fusion.agreement import ControlGroup, _verdict, canonical, fingerprint
from sdpa_fusion.layout import Layout


def test_canonical_text_is_equal_for_equal_values():
    assert canonical([1, 0.5, "a", None, torch.bfloat16, Layout.BSHE]) == \
        "[1, 0.5, 'a', None, torch.bfloat16, Layout.BSHE]"
    assert canonical({"b": 1, "a": 2}) == canonical({"a": 2, "b": 1})
    assert canonical(LoadBalanced()) == "LoadBalanced{}"


def test_canonical_text_of_index_maps_sees_their_contents():
    a, b = IndexMap([[0, 1], [2, 3]]), IndexMap([[0, 1], [2, 3]])
    assert canonical(a) == canonical(b)
    assert canonical(a) != canonical(IndexMap([[0, 2], [1, 3]]))
    assert canonical(torch.arange(3)) != canonical(torch.arange(3).float())


def test_fingerprint_is_62_bits_and_order_sensitive():
    fields = {"q_len": "64", "causal": "True"}
    h = fingerprint(fields)
    assert 0 <= h < 2 ** 62 and h == fingerprint(dict(fields))
    assert h != fingerprint({"q_len": "64", "causal": "False"})
    assert h != fingerprint({"causal": "True", "q_len": "64"})


class _Group:
    group_name = "test"


def _control(ranks):
    return ControlGroup(_Group(), ranks, datetime.timedelta(seconds=1), "mesh dim 'seq'")


def test_verdict_names_ranks_and_errors():
    control = _control([0, 1, 2, 3])
    gathered = [(None, {}), ("scale=inf must be ...", None), (None, {}), ("scale=inf must be ...", None)]
    assert _verdict(gathered, control, "attention", "fix it") == "ranks 1, 3: scale=inf must be ..."
    every = [("bad", None)] * 4
    assert _verdict(every, control, "attention", "fix it") == "every rank: bad"


def test_verdict_lists_the_fields_that_differ():
    control = _control([0, 1, 2])
    same = {"call": "attention", "q_len": "64", "dtype": "torch.float32"}
    gathered = [(None, same), (None, same), (None, {**same, "q_len": "128"})]
    assert _verdict(gathered, control, "attention", "fix it") == (
        "attention needs the same call on every rank of mesh dim 'seq', but the ranks differ in "
        "q_len (64 on ranks 0, 1 / 128 on rank 2); fix it"
    )


def test_verdict_of_ranks_at_different_calls():
    control = _control([0, 1])
    gathered = [(None, {"call": "schedules.get", "schedule": "'ring'"}),
                (None, {"call": "attention", "q_len": "64"})]
    assert _verdict(gathered, control, "attention", "fix it") == (
        "the ranks of mesh dim 'seq' are not at the same call: call (schedules.get on rank 0 / "
        "attention on rank 1); every rank must make the same calls (attention, unshard, "
        "schedules.get) in the same order"
    )


@pytest.mark.parametrize("name,expected", [
    ("ring", ["dim", "grad_dtype", "head_groups", "partition", "transport"]),
    ("allgather", ["dim", "head_groups", "partition", "transport"]),
    ("ulysses", ["dim", "head_groups", "keep_forward", "partition", "transport"]),
    ("head_parallel", ["dim"]),
    ("replicated", ["dim"]),
])
def test_schedule_options(name, expected):
    assert schedules.options(name) == expected


@pytest.mark.parametrize("options,match", [
    (dict(partiton="contiguous"), r"^schedule 'ring' takes the options \['dim', 'grad_dtype', "
                                  r"'head_groups', 'partition', 'transport'\]; 'partiton' is "
                                  r"not among them$"),
    (dict(partition="zigzag"), r"^partition='zigzag' is not known"),
    (dict(partition=[[0.0, 1.0]]), r"^index_map must hold integer token positions"),
    (dict(transport="pigeon"), r"^transport='pigeon' is not known"),
])
def test_bad_options_without_a_mesh(options, match):
    with pytest.raises(ValueError, match=match):
        schedules.get("ring", **options)


def test_unknown_schedule_and_mesh_that_is_not_one():
    with pytest.raises(ValueError, match=r"^schedule 'rnig' is not known; choose one of"):
        schedules.get("rnig")
    with pytest.raises(ValueError, match=r"^mesh='seq' must be a sdpa_fusion.Mesh"):
        schedules.get("ring", "seq")


def test_configuration_fields_show_each_option():
    fields = schedules.get("ring", partition="contiguous").configuration_fields()
    assert fields == {"schedule": "'ring'", "schedule.mesh": "None", "schedule.dim": "None",
                      "schedule.partition": "Contiguous{}", "schedule.head_groups": "'auto'",
                      "schedule.transport": "'auto'", "schedule.grad_dtype": "'auto'"}
