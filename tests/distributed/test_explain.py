"""``explain --schedule NAME --mesh P`` plans every rank on virtual meshes (no process group);
its numbers must be what the schedule built on the real mesh describes on each rank, and its
local problem the one of the rank's real shards.

    mpirun -np 4 python -m pytest tests/distributed/test_explain.py
"""

from __future__ import annotations

import json

import pytest
import torch

import schedules
import sdpa_fusion
from schedules.cli import main
from sdpa_fusion.spec import AttentionSpec

CASES = [("ring", []), ("ring", ["partition=striped"]), ("allgather", []), ("ulysses", []),
         ("head_parallel", [])]


def explained(capsys, name: str, shape: tuple[int, ...], spec: AttentionSpec,
              options: list[str]) -> dict:
    argv = ["explain", "--schedule", name, "--mesh", "x".join(map(str, shape)), "--device",
            "cpu", "--batch", str(spec.batch), "--heads", str(spec.heads), "--kv-heads",
            str(spec.kv_heads), "--seq", str(spec.q_len), "--head-dim", str(spec.head_dim),
            "--causal" if spec.causal else "--no-causal", "--dtype", "fp32", "--json"]
    for option in options:
        argv += ["--option", option]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def assert_same_numbers(row: dict, description, shards) -> None:
    """``row`` says what ``description`` says, for the local problem of ``shards`` (this
    rank's real q, k, v), and the memory of those inputs and the described call."""
    for field in ("steps", "backward_steps", "bytes_sent", "bytes_received",
                  "backward_bytes_sent", "backward_bytes_received", "flops", "backward_flops"):
        assert row[field] == getattr(description, field), field
    q, k, _ = shards
    assert row["local"] == {"batch": q.shape[0], "heads": q.shape[1], "kv_heads": k.shape[1],
                            "q_len": q.shape[2], "kv_len": k.shape[2]}
    q, k, v = (t.numel() * t.element_size() for t in shards)
    m = description.memory
    assert row["memory_bytes"] == q + k + v + m.kept + m.outputs + m.forward
    assert row["backward_memory_bytes"] == 2 * q + k + v + m.step  # dout beside q


def real_shards(sched, spec: AttentionSpec):
    """This rank's shards of real full q, k, v."""
    q = torch.zeros(spec.batch, spec.heads, spec.q_len, spec.head_dim)
    kv = torch.zeros(spec.batch, spec.kv_heads, spec.kv_len, spec.head_dim)
    return sched.shard(q), sched.shard(kv), sched.shard(kv)


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}{''.join(o)}" for n, o in CASES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_explain_numbers_are_what_each_rank_describes(mesh, capsys, name, options, causal):
    p = mesh.size()
    spec = AttentionSpec(batch=2, heads=2 * p, kv_heads=p, q_len=8 * p, kv_len=8 * p,
                         head_dim=16, dtype=torch.float32, causal=causal)
    report = explained(capsys, name, (p,), spec, options)
    sched = schedules.get(name, mesh, **dict(o.split("=") for o in options))
    assert len(report["ranks"]) == p
    assert_same_numbers(report["ranks"][mesh.rank], sched.describe(spec),
                        real_shards(sched, spec))


def test_explain_of_hybrid_matches_a_real_two_dim_mesh(mesh, capsys):
    p = mesh.size()
    if p % 2:
        pytest.skip("a 2 x P/2 mesh needs an even number of ranks")
    shape = (2, p // 2)
    mesh2 = sdpa_fusion.init_mesh(shape, ("heads", "seq"))
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, q_len=8 * p, kv_len=8 * p, head_dim=16,
                         dtype=torch.float32, causal=True)
    for inner in ("ulysses", "head_parallel"):
        report = explained(capsys, "hybrid", shape, spec, [f"inner={inner}"])
        sched = schedules.get("hybrid", mesh2, inner=inner)
        row = report["ranks"][mesh.rank]
        assert row["coordinates"] == {"heads": mesh2.coordinate("heads"),
                                      "seq": mesh2.coordinate("seq")}
        assert_same_numbers(row, sched.describe(spec), real_shards(sched, spec))
