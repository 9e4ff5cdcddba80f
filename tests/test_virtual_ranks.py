"""benchmarks.virtual_ranks runs small on CPU: every virtual rank's step right and timed; the
mailbox keeps records within its budget; every row, a failed one too, frees what it made."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from benchmarks import virtual_ranks
from benchmarks.mailbox import Mailbox


def test_tiny_run(tmp_path):
    virtual_ranks.main(["--tiny", "--ranks", "2,3", "--batches", "a,b", "--schedules",
                        "ring,allgather", "--results-dir", str(tmp_path), "--copy-to", ""])
    rows = json.loads((tmp_path / "virtual_ranks_tiny.json").read_text())["rows"]
    ranks = [r for r in rows if r["ranks"] > 1]
    assert len(ranks) == 2 * 2 * 2 * 2  # batches x schedules x partitions x rank counts
    assert {r["schedule"] for r in ranks} == {"ring", "allgather"}
    for r in ranks:  # the threaded run's check, and every replayed rank's
        assert r["status"] == "ok" and r["check"].startswith("right"), r
        assert r["check_record"].startswith("right") and r["record_runs"] == 1
        assert len(r["rank_ms"]) == r["ranks"] and min(r["rank_ms"]) > 0
        assert r["impl"].startswith(r["schedule"]), r
    a = [r for r in ranks if r["batch"] == "a" and r["partition"] == "load_balanced"]
    assert all(min(r["bytes_sent_per_rank"]) > 0 for r in a)  # every document cut: K/V travel


def test_documents_cut_over_groups_of_ranks_run_right():
    """Over 4 virtual ranks two long documents are cut over a pair of ranks each
    (``schedules.assign.plan``), and over all four with ``documents:groups=False``: every
    rank right, each sending what it receives, a third of what it sends over all four."""
    from schedules.assign import plan

    lengths = [24, 1, 3, 2, 5, 1, 4, 2] * 2
    assert plan(lengths, 4).groups == ((0, 2), (2, 2))
    sent = _sent_per_rank(lengths, 4)
    grouped, flat = sent["documents"], sent["documents:groups=False"]
    assert len(set(grouped)) == len(set(flat)) == 1 and 0 < 3 * grouped[0] == flat[0]


def test_a_rank_in_two_groups_runs_both_rings_right():
    """One document cut over all four virtual ranks and one over ranks 0-1: ranks 0 and 1
    run both rings, every rank right, the pair sending more than the others."""
    from schedules.assign import plan

    lengths = [4 * n for n in (44, 1, 2, 16, 3, 1, 2, 3, 2, 1, 4, 2, 2, 3, 1, 2)]
    a = plan(lengths, 4)
    assert a.groups == ((0, 4), (0, 2))
    sent, terms = _sent_per_rank(lengths, 4, terms=True)
    assert sent["documents"][0] == sent["documents"][1] > sent["documents"][2] \
        == sent["documents"][3] > 0
    # each rank's terms of the cost fit (docs/tables.py), as the plan that ran says
    assert terms["documents"] == [list(a.cost_terms(r)) for r in range(4)]
    assert [t[2:] for t in terms["documents:groups=False"]] == [[4, 240, 60]] * 4


def _sent_per_rank(lengths, ranks: int, terms: bool = False):
    """{partition: bytes each rank sends} of ``lengths`` over ``ranks`` virtual ranks (tiny
    shapes, ring, documents and documents:groups=False), every rank's step checked right;
    with ``terms``, also {partition: each rank's recorded cost terms}."""
    args = virtual_ranks.parse_args(["--tiny", "--ranks", str(ranks), "--schedules", "ring",
                                     "--partitions", "documents,documents:groups=False"])
    rows = []
    virtual_ranks.batch_rows(args, "g", lengths, lambda text: None,
                             lambda row: row is not None and rows.append(row))
    sent, recorded = {}, {}
    for row in rows[1:]:
        assert row["ranks"] == ranks and row["status"] == "ok", row
        assert row["check"].startswith("right"), row
        assert row["check_record"].startswith("right"), row
        sent[row["partition"]] = row["bytes_sent_per_rank"]
        recorded[row["partition"]] = [list(t) for t in row["rank_cost_terms"]]
        assert sent[row["partition"]] == row["bytes_received_per_rank"]
    return (sent, recorded) if terms else sent


def test_profile_splits_each_rank_s_device_time():
    rows, _ = _rows("--ranks", "2", "--partitions", "documents", "--profile")
    split = rows[1]["rank_device_ms"]
    assert rows[1]["status"] == "ok" and len(split) == 2, rows[1]
    # on CPU no event has device time: every part is zero
    assert split == [{"attention": 0.0, "copies": 0.0, "other": 0.0, "idle": 0.0, "ops": 0.0,
                      "largest_other": [],
                      "allocator": {"mallocs": 0, "frees": 0, "retries": 0}}] * 2, split


def test_every_rank_is_timed_before_any_is_profiled(monkeypatch):
    """The profiler slows the steps timed after it: a row times its ranks, then profiles."""
    from benchmarks import common

    order = []
    measure, device_time = common.measure, virtual_ranks.device_time
    monkeypatch.setattr(common, "measure", lambda *a, **k: order.append("timed") or
                        measure(*a, **k))
    monkeypatch.setattr(virtual_ranks, "device_time", lambda *a: order.append("profiled") or
                        device_time(*a))
    rows, _ = _rows("--ranks", "3", "--partitions", "documents", "--profile")
    assert rows[1]["status"] == "ok" and len(rows[1]["rank_device_ms"]) == 3, rows[1]
    assert order == ["timed"] * 4 + ["profiled"] * 3  # one GPU's step, then the three ranks


def test_host_profile_says_where_the_host_time_goes():
    """A step that plans whole documents to ranks (Python of ``schedules``) and runs a torch
    op: both get host time, and the functions of most time come first."""
    from schedules import assign

    def step(x):
        assign._plan.cache_clear()  # planned, not taken from the caches
        assign._assign.cache_clear()
        assign.plan([600, 24, 3000, 17, 90, 1200, 5, 64] * 8, 4)
        return x[0] @ x[0]

    found = virtual_ranks.host_profile(step, [torch.randn(256, 256)])
    packages = found["host_by_package"]
    assert packages["schedules"] > 0 and packages["~"] > 0, packages
    top = found["host_top"]
    assert 0 < len(top) <= virtual_ranks.HOST_TOP
    assert [ms for _, ms in top] == sorted((ms for _, ms in top), reverse=True)
    assert any(name.startswith("schedules/") for name, _ in top), top


def test_idle_is_the_time_no_device_work_covers():
    assert virtual_ranks.idle_ms([]) == 0.0
    # 0-1000 and 500-2000 overlap; 2500-3000 starts 500 us after them; 2600-2700 inside it
    spans = [(2500, 3000), (0, 1000), (2600, 2700), (500, 2000)]
    assert virtual_ranks.idle_ms(spans) == 0.5
    assert virtual_ranks.idle_ms([(0, 10), (10, 20)]) == 0.0


def test_device_time_kinds_of_kernels_seen_on_an_h200():
    fa4 = "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackward"
    names = {fa4: "attention",
             "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>": "attention",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention",
             "Memcpy DtoD (Device -> Device)": "copies",
             "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add>": "other",
             "nvf::nvfuser_transpose_f0_c1_r0_g0": "other"}
    assert {n: virtual_ranks.kind_of(n) for n in names} == names


def test_records_past_the_budget_drop_the_highest_rank():
    box = Mailbox(3, recording=[0, 1, 2], budget=3 * 4 * 4)  # three 4-float receives
    for src, dst in [(1, 0), (2, 1), (0, 2), (1, 0)]:
        box.send(src, dst, torch.ones(4))
        box.receive(src, dst, torch.empty(4))
    assert box.recorded == [0, 1] and len(box.records[0]) == 2
    box.replay(0)
    into = torch.empty(4)
    box.receive(1, 0, into)
    assert torch.equal(into, torch.ones(4)) and box.cursor == 1


def _held() -> tuple[int, int]:
    """(live Mailboxes, bytes of the storages of live tensors), cycles collected first."""
    gc.collect()
    boxes, storages = 0, {}
    for o in gc.get_objects():
        if isinstance(o, Mailbox):
            boxes += 1
        elif isinstance(o, torch.Tensor) and o.device.type != "meta":
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return boxes, sum(storages.values())


def _rows(*argv):
    """The rows of tiny batch a under ``argv``, and what was held as each was kept."""
    args = virtual_ranks.parse_args(["--tiny", "--batches", "a", *argv])
    rows, held = [], []

    def keep(row):
        if row is not None:  # None: a kept row changed (a later pass of --runs)
            rows.append(row)
            held.append(_held())

    virtual_ranks.batch_rows(args, "a", virtual_ranks.batches(True)["a"], lambda text: None,
                             keep)
    return rows, held


def test_runs_measure_every_row_again_against_its_own_one_gpu_step(monkeypatch):
    """``--runs 3``: each row keeps three ratios, each its pass's slowest rank x P over that
    pass's one-GPU step."""
    # per pass: one GPU, then ranks 0 and 1
    steps = iter([10.0, 6.0, 5.0, 20.0, 9.0, 11.0, 30.0, 16.0, 2.0])
    measure = virtual_ranks.common.measure

    def timed(step, *args, **kwargs):
        m = measure(step, *args, **kwargs)
        m.median_ms = next(steps)
        return m

    monkeypatch.setattr(virtual_ranks.common, "measure", timed)
    rows, _ = _rows("--ranks", "2", "--partitions", "documents", "--runs", "3")
    assert len(rows) == 2 and rows[1]["status"] == "ok", rows
    assert rows[1]["slowest_x_p_over_one_gpu_runs"] == [1.2, 1.1, 16 * 2 / 30], rows[1]
    assert rows[1]["slowest_x_p_over_one_gpu"] == 1.2


def test_every_row_frees_what_it_made():
    rows, held = _rows("--ranks", "2,3")
    assert [r["status"] for r in rows] == ["ok"] * 5
    # after the one-device row only the batch's inputs live; every later row leaves the same
    assert held == [(0, held[0][1])] * 5, held


def test_an_out_of_memory_row_frees_all_and_the_next_rows_run(monkeypatch):
    replay, failed = virtual_ranks.replay, []

    def once_out_of_memory(args, sched, *rest):
        if sched.size == 2 and not failed:
            failed.append(1)
            grabbed = torch.empty(1 << 20)  # held by the failure's traceback
            raise torch.OutOfMemoryError(f"CUDA out of memory (test), {grabbed.numel()}")
        return replay(args, sched, *rest)

    monkeypatch.setattr(virtual_ranks, "replay", once_out_of_memory)
    rows, held = _rows("--ranks", "2,3")
    assert [r["status"] for r in rows] == ["ok", "oom", "ok", "ok", "ok"], rows
    assert held == [(0, held[0][1])] * 5, held


def test_a_record_phase_out_of_memory_runs_again_keeping_half(monkeypatch):
    """The first record phase runs out of memory holding 2 MiB of receives: it runs again
    with a budget of 1 MiB, and the row is measured and right."""
    record, budgets = virtual_ranks.record, []

    def out_of_memory_once(args, scheds, inputs, cu, box, problem):
        budgets.append(box.budget)
        if len(budgets) == 1:
            box.kept = 2 << 20
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return record(args, scheds, inputs, cu, box, problem)

    monkeypatch.setattr(virtual_ranks, "record", out_of_memory_once)
    rows, held = _rows("--ranks", "2", "--partitions", "load_balanced")
    row = rows[1]
    assert row["status"] == "ok" and row["check"].startswith("right"), row
    assert budgets[1] == 1 << 20 and row["record_budget_gib"] == round(1 / 1024, 3), budgets
    assert held[1] == held[0], held


def test_ranks_past_the_record_budget_are_recorded_by_later_runs():
    rows, _ = _rows("--ranks", "4", "--partitions", "load_balanced")
    most = max(rows[1]["bytes_received_per_rank"])
    budget = 1.5 * most / (1 << 30)  # one rank's receives fit, not two
    rows, held = _rows("--ranks", "4", "--partitions", "load_balanced",
                       "--record-gib", repr(budget))
    row = rows[1]
    assert row["status"] == "ok" and row["check"].startswith("right"), row
    assert row["record_runs"] == 4 and max(row["record_gib"]) * (1 << 30) <= most, row
    assert held[1] == held[0], held


def test_schedule_entries_take_options(monkeypatch):
    """``--schedules ring:grad_dtype=input`` runs the ring with that option, in a row named
    by the entry."""
    made, virtual_schedules = [], virtual_ranks.virtual_schedules

    def recording(name, *args, **options):
        scheds = virtual_schedules(name, *args, **options)
        made.append((name, scheds[0].grad_dtype))
        return scheds

    monkeypatch.setattr(virtual_ranks, "virtual_schedules", recording)
    rows, _ = _rows("--ranks", "3", "--partitions", "load_balanced", "--schedules",
                    "ring,ring:grad_dtype=input")
    assert made == [("ring", "auto"), ("ring", "input")]
    given = rows[2]
    assert given["impl"] == "ring:grad_dtype=input load_balanced P=3"
    assert given["status"] == "ok" and given["check"].startswith("right"), given


def test_no_row_starts_past_max_seconds():
    """Past ``--max-seconds`` the rows not yet begun are left out (the one-GPU row of a batch
    begun in time is kept); a GPU session's budget ends the run, not a timeout."""
    import time

    args = virtual_ranks.parse_args(["--tiny", "--batches", "a", "--ranks", "2",
                                     "--max-seconds", "1"])
    args.deadline = time.monotonic() - 1.0
    rows = []
    virtual_ranks.batch_rows(args, "a", virtual_ranks.batches(True)["a"], lambda text: None,
                             rows.append)
    assert [r["ranks"] for r in rows] == [1]


def test_transfers_name_where_receives_run():
    """On CPU every receive runs where it is made; an unknown --transfers is refused."""
    for transfers in ("side", "inline"):
        box = Mailbox(2, recording=[0], transfers=transfers)
        box.replay(0)
        assert box.side_stream("cpu") is None
    with pytest.raises(ValueError, match="transfers='both'.*side"):
        Mailbox(2, transfers="both")
    rows, _ = _rows("--ranks", "2", "--partitions", "documents", "--transfers", "inline")
    assert rows[1]["status"] == "ok" and rows[1]["check"].startswith("right"), rows[1]


@pytest.mark.parametrize("schedule", ["ring", "ulysses"])
def test_a_replayed_rank_keeps_one_receive_buffer(monkeypatch, schedule):
    """As the copy-engine transport does: every step of a replayed rank receives (the ring's
    K/V slots, ulysses' exchange regions) into one buffer the rank keeps, where the ranks
    recording take fresh ones; every rank right."""
    from benchmarks.mailbox import VirtualMover

    given = {True: [], False: []}  # replaying: every buffer handed out, held
    buffer = VirtualMover.buffer

    def watched(self, nbytes, device):
        flat = buffer(self, nbytes, device)
        given[self.mailbox.replaying is not None].append(flat)
        return flat

    monkeypatch.setattr(VirtualMover, "buffer", watched)
    args = virtual_ranks.parse_args(["--tiny", "--ranks", "2", "--schedules", schedule,
                                     "--partitions", "load_balanced"])
    rows = []
    virtual_ranks.batch_rows(args, "a", virtual_ranks.batches(True)["a"], lambda text: None,
                             lambda row: row is not None and rows.append(row))
    assert len(rows) == 2 and rows[1]["check"].startswith("right"), rows
    replayed, recorded = given[True], given[False]
    # per rank the forward's, then the backward's larger one, kept for every later step
    assert len(replayed) >= 8 and len({t.data_ptr() for t in replayed}) <= 2 * 2
    assert len({t.data_ptr() for t in recorded}) == len(recorded) > 2
