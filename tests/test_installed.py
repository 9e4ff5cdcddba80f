"""sdpa-fusion installed from its wheel, used away from the checkout: the ``sdpa-fusion``
command plans a mesh with the packaged cost table (no benchmark results are packaged), and
``python -m benchmarks`` runs a benchmark whose results go to the current directory.
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


def run(installed: Path, cwd: Path, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_command_plans_a_mesh_with_the_packaged_cost_table(installed, tmp_path):
    done = run(installed, tmp_path, str(installed / "bin" / "sdpa-fusion"), "explain",
               "--schedule", "ring", "--mesh", "4", "--seq", "131072", "--heads", "32",
               "--head-dim", "128", "--causal")
    assert done.returncode == 0, done.stderr
    table = json.loads((ROOT / "schedules" / "cost_table.json").read_text())
    assert f"predicted on {next(iter(table['devices']))} with kernel" in done.stdout
    assert "sdpa-fusion" not in done.stderr
    assert (installed / "schedules" / "cost_table.json").is_file()
    assert not (installed / "benchmarks" / "results").exists()


def test_the_command_runs_the_demo(installed, tmp_path):
    done = run(installed, tmp_path, str(installed / "bin" / "sdpa-fusion"), "demo", "--device",
               "cpu", "--seq", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16")
    assert done.returncode == 0, done.stderr
    assert "demo: all checks passed" in done.stdout


def test_a_benchmark_writes_its_results_into_the_current_directory(installed, tmp_path):
    done = run(installed, tmp_path, sys.executable, "-m", "benchmarks", "single_gpu", "--tiny",
               "--impls", "reference", "--causal", "yes", "--no-kernel-table", "--copy-to", "")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "single_gpu_tiny.json").is_file()
    assert "[####################] 4/4 100%" in done.stdout
    assert not (installed / "benchmarks" / "results").exists()
