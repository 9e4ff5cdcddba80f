"""sdpa-fusion installed from its wheel, used away from the checkout: the ``sdpa-fusion``
command plans a mesh from the packaged benchmark results and runs a benchmark whose results
go to the current directory.
Run: pytest -q tests/test_installed.py"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "sdpa_fusion", "schedules", "benchmarks")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A directory holding the package installed from a copy of the checkout (no deps)."""
    tmp = tmp_path_factory.mktemp("installed")
    source = tmp / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*_tiny.*"))
        else:
            shutil.copy2(ROOT / name, source / name)
    target = tmp / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-build-isolation", "--no-index", "--target", str(target),
                           str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return target


def sdpa_fusion(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    return subprocess.run([str(installed / "bin" / "sdpa-fusion"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_command_plans_a_mesh_from_the_packaged_results(installed, tmp_path):
    done = sdpa_fusion(installed, tmp_path, "explain", "--schedule", "ring", "--mesh", "4",
                       "--seq", "131072", "--heads", "32", "--head-dim", "128", "--causal")
    assert done.returncode == 0, done.stderr
    record = json.loads((ROOT / "benchmarks/results/context_parallel.json").read_text())
    (row,) = [r for r in record["rows"] if r["impl"] == "ring" and r["seq_len"] == 131072
              and r["panel"] == "causal fwd+bwd"]
    assert f"last measurement, fwd+bwd: {row['median_ms']:.1f} ms" in done.stdout
    assert "sdpa-fusion" not in done.stderr


def test_bench_writes_its_results_into_the_current_directory(installed, tmp_path):
    done = sdpa_fusion(installed, tmp_path, "bench", "single_gpu", "--tiny", "--impls",
                       "reference", "--causal", "yes", "--no-kernel-table", "--copy-to", "")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "single_gpu_tiny.json").is_file()
    assert "[####################] 4/4 100%" in done.stdout
    assert not list((installed / "benchmarks" / "results").glob("*_tiny.json"))
