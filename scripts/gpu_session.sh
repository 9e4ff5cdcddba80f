#!/usr/bin/env bash
# GPU tests and benchmarks on one machine of 4 GPUs, in one command, every step under
# `timeout`, everything collected flat into $OUT (at most MAX_FILES files, default 8, so
# that the results travel back from a remote machine as a few files).
#
#   scripts/gpu_session.sh [PART ...]          from the repo root
#
# PARTs, run in the order given (default: all):
#   tests            tests-gpu, then tests-dist
#   tests-gpu        python -m pytest -q tests/gpu, on GPU 0, but for test_long.py (~3 min
#                    with FA4, its first calls compiling)
#   tests-gpu-long   tests/gpu/test_long.py alone: every kernel past 2^31-element offsets
#                    (10 min or more while its 512-head cases checked every head; now 32)
#   tests-dist       mpirun -np $NP python -m pytest -q tests/gpu_distributed
#   bench            bench-single, bench-hp, bench-cp
#   bench-single     python -m benchmarks.single_gpu                     (~4 min)
#   bench-hp         mpirun -np $NP python -m benchmarks.head_parallel   (~1 min)
#   bench-cp         bench-cp-single, then bench-cp-dist
#   bench-cp-single  python -m benchmarks.context_parallel --single-gpu  (~1.5 min)
#   bench-cp-dist    mpirun -np $NP python -m benchmarks.context_parallel (~4-5 min; keeps
#                    the one-GPU rows bench-cp-single wrote into context_parallel.json)
#   bench-cp-goals   the goals of context parallelism (NP=2): context_parallel --preset goals
#                    --single-gpu, then under mpirun (~2 + ~5 min)
#   profile-ring     mpirun -np $NP python -m benchmarks.profile_ring      (~30 s)
#   bench-transport  mpirun -np $NP python -m benchmarks.ring_transport    (~1 min)
#   bench-hybrid     mpirun -np $NP python -m benchmarks.hybrid            (~3 min on 2)
#   bench-thd-cp     mpirun -np $NP python -m benchmarks.thd_context_parallel
#                    (packed batches and a 4K window at 128K; ~3 min on 2)
#   bench-docs-goals the two-GPU goals of whole documents to ranks (NP=2): packed batches a-d
#                    under ring, documents against load_balanced, and ulysses with documents,
#                    every rank checked: thd_context_parallel --preset documents (~6 min on 2)
#   bench-vr         packed batches over virtual ranks on one GPU (whole documents; ring with
#                    input-dtype sums beside ulysses, one and two head groups; device time
#                    split): benchmarks.virtual_ranks (~6 min)
#   bench-vr-goals   the same goals measured three times in one run (--runs 3 --profile;
#                    documents, under VR_SCHEDULES, default ring with input-dtype sums;
#                    5-7 min): the goals' spread
#   bench-max-seq    the longest trainable sequence (NP=2): max_seq --single-gpu, then under
#                    mpirun (confirmation steps within CONFIRM_S each; default 120)
#   all              tests, then bench, not tests-gpu-long (12-15 min; to keep each command
#                    under 10 min, run `tests`, then `bench-single bench-hp`, then `bench-cp`)
#
# Environment: OUT (where results go; default benchmarks/results/session), NP (ranks; 4),
# BUDGET_S (seconds this whole command may take; 540: each step gets at most what is left,
# and the benchmarks stop starting new cases in time to write their results), PYTHON
# (python3), MPIRUN (mpirun), MPI_EXTRA (more mpirun options, e.g. --oversubscribe),
# BENCH_ARGS (more options for every benchmark, e.g. --tiny to try this script on CPU ranks),
# CP_ARGS (more options for bench-cp-dist, e.g. --seq-lens 32k,128k), GPU (the GPU of the
# single-GPU steps; 0). Each benchmark writes its one result, benchmarks/results/<name>.json.
#
# What lands in $OUT: summary.txt (each step's status and time, the benchmarks' tables, the
# tests' summaries), session.tar.gz (every log and every result JSON/PNG), and the JSON, then
# the PNG, of each benchmark run by this command, as many as MAX_FILES allows.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

OUT="${OUT:-$PWD/benchmarks/results/session}"
NP="${NP:-4}"
MAX_FILES="${MAX_FILES:-8}"
PY="${PYTHON:-python3}"
MPIRUN="${MPIRUN:-mpirun}"
read -r -a MPI_EXTRA <<< "${MPI_EXTRA:-}"
read -r -a BENCH_ARGS <<< "${BENCH_ARGS:-}"
read -r -a CP_ARGS <<< "${CP_ARGS:-}"
BUDGET_S="${BUDGET_S:-540}"
RESERVE_S=20                      # kept back for collecting the results
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
RESULTS=benchmarks/results
LOGS="$(mktemp -d)/logs"
mkdir -p "$OUT" "$LOGS" "$RESULTS"
SUMMARY="$LOGS/summary.txt"
RESULT_NAMES=()
STEP_LOGS=()
export PYTHONUNBUFFERED=1

MPI=("$MPIRUN" -np "$NP" --bind-to none "${MPI_EXTRA[@]}")
ONE_GPU=(env CUDA_VISIBLE_DEVICES="${GPU:-0}")   # single-GPU steps run on this GPU

note() { echo "$*" | tee -a "$SUMMARY"; }

# limit MAX: seconds the next step may take (at most MAX); fails when too little is left.
limit() {
    local left=$((DEADLINE - RESERVE_S - $(date +%s)))
    if ((left < 45)); then return 1; fi
    echo $(($1 < left ? $1 : left))
}

# step NAME SECONDS CMD...: run CMD under timeout, log to NAME.log, record status and time.
step() {
    local name=$1 seconds=$2 t0 rc
    shift 2
    t0=$(date +%s)
    STEP_LOGS+=("$LOGS/$name.log")
    echo "=== $name (limit ${seconds}s): $*" | tee "$LOGS/$name.log"
    timeout -k 20 "$seconds" "$@" >> "$LOGS/$name.log" 2>&1
    rc=$?
    local status="rc=$rc"
    ((rc == 124 || rc == 137)) && status="TIMED OUT after ${seconds}s"
    note "$(printf '%-16s %-26s %4ds' "$name" "$status" $(($(date +%s) - t0)))"
    return $rc
}

skip() { note "$(printf '%-16s %s' "$1" "SKIPPED: $2")"; }

pytest_args() {
    local args=(-q -rfEs --color=no -p no:cacheprovider -o faulthandler_timeout=180)
    if "$PY" -c 'import pytest_timeout' 2>/dev/null; then args+=(--timeout=240); fi
    echo "${args[@]}"
}

tests_gpu() {
    local t
    [ -d tests/gpu ] || { skip tests-gpu "no tests/gpu"; return; }
    t=$(limit 300) || { skip tests-gpu "time budget"; return; }
    # shellcheck disable=SC2046
    step tests-gpu "$t" "${ONE_GPU[@]}" "$PY" -m pytest $(pytest_args) tests/gpu \
        --ignore=tests/gpu/test_long.py
}

tests_gpu_long() {
    local t
    [ -f tests/gpu/test_long.py ] || { skip tests-gpu-long "no tests/gpu/test_long.py"; return; }
    t=$(limit 900) || { skip tests-gpu-long "time budget"; return; }
    # shellcheck disable=SC2046
    step tests-gpu-long "$t" "${ONE_GPU[@]}" "$PY" -m pytest $(pytest_args) --durations=0 \
        tests/gpu/test_long.py
}

tests_dist() {
    local t dir
    for dir in tests/gpu_distributed; do
        [ -d "$dir" ] || { skip "${dir#tests/}" "no $dir"; continue; }
        t=$(limit 300) || { skip "${dir#tests/}" "time budget"; continue; }
        # shellcheck disable=SC2046
        step "${dir#tests/}" "$t" "${MPI[@]}" --tag-output "$PY" -m pytest $(pytest_args) "$dir"
    done
}

# bench NAME RESULT MAX MARGIN CMD...: a benchmark told to stop starting cases MARGIN s early,
# its result RESULT removed first (none of an earlier run is collected as this one's).
bench() {
    rm -f "$RESULTS/$2".{json,png} "$RESULTS/${2}_tiny".{json,png}
    bench_into "$@"
}

# bench_into NAME RESULT MAX MARGIN CMD...: the same into the result a step before wrote, which
# the benchmark reads (the one-GPU rows of context_parallel and max_seq).
bench_into() {
    local name=$1 result=$2 max=$3 margin=$4 t
    shift 4
    [[ " ${RESULT_NAMES[*]} " == *" $result "* ]] || RESULT_NAMES+=("$result")
    t=$(limit "$max") || { skip "$name" "time budget"; return; }
    step "$name" "$t" "$@" --max-seconds $((t - margin > 30 ? t - margin : 30)) --copy-to '' \
        "${BENCH_ARGS[@]}"
}

bench_single() {
    bench bench-single single_gpu 330 40 "${ONE_GPU[@]}" "$PY" -m benchmarks.single_gpu
}
bench_hp() {
    bench bench-hp head_parallel 240 40 "${MPI[@]}" "$PY" -m benchmarks.head_parallel
}
bench_cp_single() {
    bench bench-cp-single context_parallel 240 70 \
        "${ONE_GPU[@]}" "$PY" -m benchmarks.context_parallel --single-gpu
}
bench_cp_dist() {
    bench_into bench-cp-dist context_parallel 480 110 "${MPI[@]}" "$PY" \
        -m benchmarks.context_parallel "${CP_ARGS[@]}"
}

bench_cp_goals() {
    bench bench-cp-goals-single context_parallel 200 40 \
        "${ONE_GPU[@]}" "$PY" -m benchmarks.context_parallel --preset goals --single-gpu
    bench_into bench-cp-goals context_parallel 420 60 "${MPI[@]}" "$PY" \
        -m benchmarks.context_parallel --preset goals
}

bench_hybrid() {
    bench bench-hybrid hybrid 330 80 "${MPI[@]}" "$PY" -m benchmarks.hybrid
}

bench_thd_cp() {
    bench bench-thd-cp thd_context_parallel 330 60 "${MPI[@]}" "$PY" \
        -m benchmarks.thd_context_parallel
}

bench_docs_goals() {
    bench bench-docs-goals thd_context_parallel_documents 480 60 "${MPI[@]}" "$PY" \
        -m benchmarks.thd_context_parallel --preset documents
}

bench_max_seq() {
    bench bench-max-seq-single max_seq 200 30 "${ONE_GPU[@]}" "$PY" -m benchmarks.max_seq \
        --single-gpu --confirm-budget-s "${CONFIRM_S:-120}"
    bench_into bench-max-seq max_seq 420 30 "${MPI[@]}" "$PY" -m benchmarks.max_seq \
        --confirm-budget-s "${CONFIRM_S:-120}"
}

bench_vr() {
    bench bench-vr virtual_ranks 540 40 "${ONE_GPU[@]}" "$PY" -m benchmarks.virtual_ranks \
        --partitions documents --profile \
        --schedules ring:grad_dtype=input,ulysses,ulysses:head_groups=2
}
bench_vr_goals() {
    bench bench-vr-goals virtual_ranks 540 40 "${ONE_GPU[@]}" "$PY" -m benchmarks.virtual_ranks \
        --partitions documents --schedules "${VR_SCHEDULES:-ring:grad_dtype=input}" --runs 3 \
        --profile
}

bench_transport() {
    bench bench-transport ring_transport 150 30 "${MPI[@]}" "$PY" -m benchmarks.ring_transport
}

profile_ring() {
    local t
    t=$(limit 120) || { skip profile-ring "time budget"; return; }
    step profile-ring "$t" "${MPI[@]}" "$PY" -m benchmarks.profile_ring
}

# Everything into $OUT: summary.txt, session.tar.gz, then result files up to MAX_FILES.
collect() {
    local name f count=2
    {
        echo
        echo "elapsed $(($(date +%s) - START))s of a ${BUDGET_S}s budget"
        for f in "${STEP_LOGS[@]}"; do
            echo
            echo "----- $(basename "$f")"
            # pytest: the result line of every rank, and the failures
            grep -E '([0-9]+ (passed|failed|errors?|skipped)|no tests ran).* in [0-9.]+s' "$f" \
                | sed -E 's/^\[[0-9]+,[0-9]+\]<std[a-z]+>: ?//' | sort | uniq -c
            grep -E '^(\[[0-9]+,[0-9]+\]<std[a-z]+>: ?)?(FAILED|ERROR) ' "$f" | head -n 40
            # benchmarks: the tables at the end; anything else: its last lines
            if grep -q '^TFLOP/s' "$f"; then sed -n '/^TFLOP\/s/,$p' "$f"; else tail -n 25 "$f"; fi
        done
    } >> "$SUMMARY"
    cp "$SUMMARY" "$OUT/summary.txt"
    local results=()
    for f in "$RESULTS"/*.json "$RESULTS"/*.png; do [ -f "$f" ] && results+=("$f"); done
    local tar_args=(-C "$(dirname "$LOGS")" logs)
    ((${#results[@]})) && tar_args+=(-C "$PWD" "${results[@]}")
    tar -czf "$OUT/session.tar.gz" "${tar_args[@]}"
    for ext in json png; do
        for name in "${RESULT_NAMES[@]}"; do
            for f in "$RESULTS/$name.$ext" "$RESULTS/${name}_tiny.$ext"; do
                if [ -f "$f" ] && ((count < MAX_FILES)); then cp "$f" "$OUT/"; count=$((count + 1)); fi
            done
        done
    done
    echo "results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}
trap collect EXIT

{
    echo "gpu_session: parts ${*:-all}; $(date -u '+%Y-%m-%dT%H:%M:%SZ'); NP=$NP"
    nvidia-smi --query-gpu=index,name,memory.used,memory.total,clocks.sm,power.draw \
        --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
                                  "gpus", torch.cuda.device_count())'
} 2>&1 | tee -a "$SUMMARY"

parts=("$@")
((${#parts[@]})) || parts=(all)
for part in "${parts[@]}"; do
    case "$part" in
        all) tests_gpu; tests_dist; bench_single; bench_hp; bench_cp_single; bench_cp_dist ;;
        tests) tests_gpu; tests_dist ;;
        tests-gpu) tests_gpu ;;
        tests-gpu-long) tests_gpu_long ;;
        tests-dist) tests_dist ;;
        bench) bench_single; bench_hp; bench_cp_single; bench_cp_dist ;;
        bench-single) bench_single ;;
        bench-hp) bench_hp ;;
        bench-cp) bench_cp_single; bench_cp_dist ;;
        bench-cp-single) bench_cp_single ;;
        bench-cp-dist) bench_cp_dist ;;
        bench-cp-goals) bench_cp_goals ;;
        profile-ring) profile_ring ;;
        bench-transport) bench_transport ;;
        bench-hybrid) bench_hybrid ;;
        bench-thd-cp) bench_thd_cp ;;
        bench-max-seq) bench_max_seq ;;
        bench-vr) bench_vr ;;
        bench-vr-goals) bench_vr_goals ;;
        bench-docs-goals) bench_docs_goals ;;
        *) note "unknown part '$part'; see the top of $0"; exit 2 ;;
    esac
done
