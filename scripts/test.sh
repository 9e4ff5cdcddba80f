#!/usr/bin/env bash
# The whole test suite on this machine (CPU is enough; GPU tests skip without a GPU):
#   1. single-process tests:   pytest -q tests  (tests/distributed left out)
#   2. distributed tests:      mpirun -np 2 ... pytest -q tests/distributed
#   3.                         mpirun -np 4 ... pytest -q tests/distributed
#   4.                         mpirun -np 3 ... (whole documents and non-finite values:
#                              ranks that do not divide the batch's powers of two)
#   5.                         mpirun -np 8 ... (the tests whose plans change past four
#                              ranks: whole documents, 2-D meshes, hybrid)
# Each stage runs under `timeout`; the script fails if any stage fails, times out or
# collects no tests (unless extra arguments chose the tests). Extra arguments go to every
# pytest run (e.g. -x, -k ring).
#
# Environment: SDPA_FUSION_VENV (default .venv), SDPA_TEST_TIMEOUT_S (single-process stage,
# default 900), SDPA_MPI_TIMEOUT_S (each mpirun stage, default 900).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SDPA_FUSION_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
  echo "test: $PY not found; run scripts/setup.sh (or make test) first" >&2
  exit 2
fi

export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
# Open MPI refuses to start as root without these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A collective that waits this long fails instead of hanging the suite.
export SDPA_FUSION_TIMEOUT_S="${SDPA_FUSION_TIMEOUT_S:-120}"
SINGLE_TIMEOUT="${SDPA_TEST_TIMEOUT_S:-900}"
MPI_TIMEOUT="${SDPA_MPI_TIMEOUT_S:-900}"

# Colours only on a terminal (several ranks share one output stream under mpirun).
color=no
[[ -t 1 ]] && color=yes

summary=()
failed=0
chosen=$#  # extra pytest arguments: a stage may then match no test

# stage NAME TIMEOUT_S COMMAND...
stage() {
  local name="$1" limit="$2"
  shift 2
  echo
  echo "=== $name: $*"
  local start=$SECONDS rc verdict
  timeout --kill-after=30 "$limit" "$@"
  rc=$?
  case "$rc" in
    0) verdict="passed" ;;
    5) if [[ "$chosen" == 0 ]]; then verdict="FAILED: no tests were collected (pytest exit 5)"
       else verdict="passed (no test matched the arguments)"; rc=0; fi ;;
    124 | 137) verdict="FAILED: timed out after ${limit} s" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  [[ "$rc" == 0 ]] || failed=1
  summary+=("$(printf '%-34s %-48s %5d s' "$name" "$verdict" $((SECONDS - start)))")
}

stage "single-process (pytest tests)" "$SINGLE_TIMEOUT" \
  "$PY" -m pytest -q --color="$color" --ignore=tests/distributed tests "$@"

# distributed NP NAME FILES...: FILES under mpirun -np NP. Several ranks share few cores: one
# intra-op thread per rank, no core binding; every output line tagged with the rank that wrote it.
distributed() {
  local np="$1" name="$2"
  shift 2
  stage "distributed (mpirun -np $np$name)" "$MPI_TIMEOUT" \
    env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    "$VENV/bin/mpirun" -np "$np" --oversubscribe --bind-to none --output tag \
    "$PY" -m pytest -q --color="$color" "$@"
}

distributed 2 "" tests/distributed "$@"
distributed 4 "" tests/distributed "$@"
distributed 3 ", documents" tests/distributed/test_thd_documents.py \
  tests/distributed/test_nonfinite.py "$@"
# Eight ranks on a small CI machine run each test four to a core; the whole directory there
# takes past any sensible limit, and every schedule's other paths already ran at 2 and 4.
distributed 8 ", documents and 2-D meshes" tests/distributed/test_thd_documents.py \
  tests/distributed/test_mesh_2d.py tests/distributed/test_hybrid.py "$@"

echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
if [[ "$failed" != 0 ]]; then
  echo "=== test suite FAILED"
  exit 1
fi
echo "=== test suite passed"
