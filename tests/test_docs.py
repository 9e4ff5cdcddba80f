"""The docs stay true to the code: schedules.md's diagrams are what docs/draw_schedules.py
computes from the schedules now, its pictures can be drawn, the generated tables of the README
and docs/benchmarks.md are what docs/tables.py computes now, the README stays a front door
(at most 300 lines), every link resolves, and every code block of custom_schedule.md is a
piece of the example the tests run.
Run: pytest -q tests/test_docs.py"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def draw_schedules():
    spec = importlib.util.spec_from_file_location("draw_schedules", DOCS / "draw_schedules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("docs_tables", DOCS / "tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_the_readme_is_a_front_door_of_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"


def test_every_generated_table_sits_in_a_doc(tables):
    marked = {name for doc in tables.DOCS
              for _, name, _, _ in tables.MARK.findall((ROOT / doc).read_text())}
    assert marked == set(tables.TABLES)


def test_the_memory_table_is_what_the_schedules_describe_now(tables):
    readme = (ROOT / "README.md").read_text()
    assert tables.fill(readme, only={"memory"}) == readme, "run python docs/tables.py"


@pytest.mark.parametrize("doc", ["README.md", "docs/benchmarks.md"])
def test_the_tables_from_committed_results_are_current(tables, doc):
    if tables.file_commit("context_parallel.json") == "?" or not tables.history_available():
        pytest.skip("needs the git history of benchmarks/results")
    text = (ROOT / doc).read_text()
    wanted = tables.fill(text, only=set(tables.TABLES) - {"memory"})
    assert wanted == text, "run python docs/tables.py"


def test_a_rank_s_cost_terms_are_its_share_of_the_plan(tables):
    # P = 2: the 100-token document has more tokens than a share and is cut over both ranks
    # (a ring of two steps over its 100 tokens); the two 1-token ones stay whole, one a rank
    row = {"ranks": 2}  # a row from before the terms were recorded: the plan by work alone
    for rank in (0, 1):
        pairs, tokens, steps, cut = tables.rank_terms(row, [100, 1, 1], rank)
        assert pairs == pytest.approx((100 * 100 / 2 / 2 + 0.5) / 1e6)
        assert (tokens, steps, cut) == pytest.approx((51 / 1024, 2.0, 100 / 1024))
    # nothing cut: no ring
    assert tables.rank_terms(row, [3, 3], 1) == pytest.approx((4.5e-6, 3 / 1024, 0.0, 0.0))
    # a row that recorded them: its own, in M pairs, K tokens, steps and K tokens cut
    recorded = {"ranks": 2, "rank_cost_terms": [[2e6, 2048, 2, 1024], [1e6, 1024, 4, 3072]]}
    assert tables.rank_terms(recorded, [3, 3], 1) == pytest.approx((1.0, 1.0, 4.0, 3.0))


def test_the_cost_fit_recovers_the_costs_it_was_made_from(tables):
    costs = [0.09, 0.05, 0.2, 0.02]
    terms = [(400.0, 33.0, 8.0, 48.0), (90.0, 68.0, 6.0, 30.0), (450.0, 35.0, 6.0, 65.0),
             (89.0, 69.0, 2.0, 17.0), (12.0, 40.0, 0.0, 0.0), (220.0, 32.0, 12.0, 67.0)]
    found = [(None, None, 0, t, sum(c * x for c, x in zip(costs, t))) for t in terms]
    found.append((None, None, 0, (1.0, 1.0, 0.0, 0.0), 1e3))  # no ring: left out of the fit
    assert tables.cost_fit(found) == pytest.approx(costs, rel=1e-6)


def test_the_placements_ulysses_costs_are_its_fits(tables):
    """``ULYSSES`` and ``ULYSSES_KEPT`` price a token held of a cut document within 5% of
    what the fit over ``ulysses``' measured ranks says it costs, in pairs."""
    if not tables.history_available():
        pytest.skip("needs the git history of benchmarks/results")
    found = tables._cost_rows(tables.ULYSSES_COST_RUNS, "ulysses", tables.held_terms)
    for setting in ("ulysses", "ulysses:keep_forward=True"):
        c = tables.cost_fit([x for x in found if x[1]["schedule"] == setting])
        priced = tables._exchange(setting).per_held_token
        assert priced == pytest.approx(1e3 * c[2] / c[0], rel=0.05), setting


def test_a_goal_is_met_only_when_three_runs_or_more_all_clear_it(tables):
    assert tables.verdict([0.951, 0.96, 0.97], 0.95, True) == "yes"
    assert tables.verdict([0.951], 0.95, True) == "not shown: 1 run"
    assert tables.verdict([0.951, 0.96], 0.95, True) == "not shown: 2 runs"
    assert tables.verdict([0.949, 0.96, 0.97], 0.95, True) == "no: 2 of 3 runs clear it"
    assert tables.verdict([0.58, 0.59, 0.6], 0.6, False) == "yes"
    # three passes of the newest run decide alone; fewer do not
    assert tables.verdict([1.3, 1.05, 1.06, 1.07], 1.1, False, [1.05, 1.06, 1.07]) == "yes"
    assert tables.verdict([1.3, 1.05, 1.12, 1.07], 1.1, False, [1.05, 1.12, 1.07]) == \
        "no: 2 of 3 runs clear it"
    assert tables.verdict([1.3, 1.05, 1.06], 1.1, False, [1.05, 1.06]) == \
        "no: 2 of 3 runs clear it"


def test_schedule_diagrams_are_current(draw_schedules):
    markdown = (DOCS / "schedules.md").read_text()
    drawn = draw_schedules.MARK.findall(markdown)
    assert {name for _, name, _, _ in drawn} == set(draw_schedules.TEXTS)
    assert draw_schedules.fill(markdown) == markdown, "run python docs/draw_schedules.py"


def test_the_ring_diagram_matches_the_load_balanced_picture_of_the_partition(draw_schedules):
    # rank 0 holds chunks 0 and 7 of 8: tokens 0-1 and 14-15; at step 1 it holds rank 3's
    # block (tokens 6-9), all of them after its early chunk: only its late queries attend
    source, case, pairs = draw_schedules.ring_step("load_balanced", 1, 0)
    assert (source, case.name) == (3, "LATE_QUERIES")
    assert sorted(map(tuple, pairs.nonzero().tolist())) == [
        (q, k) for q in (14, 15) for k in (6, 7, 8, 9)]


def test_the_pictures_are_drawn(draw_schedules, tmp_path):
    paths = draw_schedules.draw(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == sorted(p.name for p in (DOCS / "images").glob("*.png"))
    assert all(p.stat().st_size > 1000 for p in paths)


def test_every_link_of_the_docs_and_readme_resolves():
    files = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *DOCS.glob("*.md")]
    for md in files:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if not target.startswith("http"):
                assert (md.parent / target).exists(), f"{md.name}: {target}"
    readme = (ROOT / "README.md").read_text()
    for doc in DOCS.glob("*.md"):
        assert f"(docs/{doc.name})" in readme, f"README does not link docs/{doc.name}"


def test_custom_schedule_doc_shows_the_tested_example():
    example = (ROOT / "examples" / "custom_schedule.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "custom_schedule.md").read_text(), re.S)
    assert len(blocks) >= 6
    for block in blocks:
        assert block in example, block[:80]
