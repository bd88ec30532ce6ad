#!/usr/bin/env bash
# The GPU checks of issue 42 in one run, for a machine lent for a few minutes: the CUDA tests, cuda_step.py
# per-step and auto at three step lengths, the snapshot pipeline's stages against the device-to-host, memcpy and
# TCP limits, and a one-node + spare hot swap on the GPU. Every figure goes as JSON under OUT; summary.json says
# each stage's status and the targets (docs/gpu.md).
#
#   bash benchmarks/gpu.sh [--dry-run | --print] [OUT]      (OUT defaults to $OUT)
#
#   --dry-run (GPU_SH_DRY_RUN=1)      every stage on this CPU with tiny sizes (what a test can run here)
#   --print   (GPU_SH_DRY_RUN=print)  say what each stage would run on the GPU, run nothing
#   GPU_SH_ONLY=tests,hotswap         only these stages (a rerun of the ones that failed)
#   GPU_SH_BUDGET_S=470               the whole run's time: each stage's timeout is cut to what is left
#   GPU_SH_TEST_WORKERS=3             pytest-xdist workers for the tests where xdist is there (0: one process)
#   PYTHON=python                     the interpreter (the machine's own: nothing is installed from the network)
#
# Exits 0 when every stage ran and measured what it should, else 1 (the failures: summary.json, logs/).
# Targets are reported, never failed on.

set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$REPO/benchmarks/gpu.sh"
SUMMARY="$REPO/benchmarks/gpu_summary.py"
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3

# ------------------------------------------------------------------------------------------------ preflight
# Run as its own stage (under timeout, like the others): `gpu.sh __preflight OUT DRY`.
if [[ ${1:-} == __preflight ]]; then
    out=$2 dry=$3
    echo "nvidia-smi:"
    if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi || true; else echo "  (not on PATH)"; fi
    # the project's code under test is this working tree; an install is needed only where the package is not
    # importable as the machine is set up (no network: no dependencies, no build isolation)
    if ! (cd / && PYTHONPATH=${GPU_SH_ORIG_PYTHONPATH:-} "$PY" -c "import dprun") >/dev/null 2>&1; then
        echo "dprun is not importable: pip install -e . --no-deps"
        if ! timeout 120 "$PY" -m pip install -q -e "$REPO" --no-deps --no-build-isolation; then
            echo "  the install failed; the stages run with PYTHONPATH=$REPO"
        fi
    fi
    no_cuda=0
    if [[ -z $dry ]]; then
        echo "python -c 'import torch; assert torch.cuda.is_available()'"
        "$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'" || no_cuda=3
    fi
    # what the machine has (preflight.json), also where the check above failed: the why is in it
    "$PY" "$SUMMARY" preflight --json "$out/preflight.json" ${dry:+--dry-run}
    rc=$?
    exit $((no_cuda ? no_cuda : rc))
fi

# ------------------------------------------------------------------------------------------------ arguments
DRY=${GPU_SH_DRY_RUN:-}
OUT_DIR=
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        --print) DRY=print ;;
        -h | --help) sed -n '2,17p' "$SELF" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu.sh: unknown option $arg" >&2; exit 2 ;;
        *) OUT_DIR=$arg ;;
    esac
done
case $DRY in
    '' | 0) DRY= ;;
    print) ;;
    *) DRY=1 ;;
esac
OUT_DIR=${OUT_DIR:-${OUT:-}}
if [[ -z $OUT_DIR ]]; then
    echo "usage: bash benchmarks/gpu.sh [--dry-run | --print] OUT   (or OUT in the environment)" >&2
    exit 2
fi
mkdir -p "$OUT_DIR/stages" "$OUT_DIR/logs" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
BUDGET=${GPU_SH_BUDGET_S:-470} # under 8 minutes in all, the summary included
ONLY=${GPU_SH_ONLY:-}
RESERVE_S=10   # kept for the summary at the end
MIN_STAGE_S=20 # a stage with less time left than this is not started (it could not measure anything)

# the stages' temporary files (pytest's, the agents' ipc sockets: short paths) go when the run ends
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpush-XXXXXX")
export TMPDIR=$WORK
export GPU_SH_ORIG_PYTHONPATH=${PYTHONPATH:-}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" # this tree's code, also in the processes dprun starts
export PYTHONUNBUFFERED=1
# Every process a stage starts inherits this mark: those left behind by a stage (started in sessions of their
# own, which timeout's signal to its process group misses) are found by it and ended, by their pids.
RUN_ID="$$-$RANDOM$RANDOM"
export GPU_SH_RUN=$RUN_ID

# In the order they run: the figures the issue's targets need first (the GPU's minutes are few), the 0.5 s
# point last; the tests after the measurements, so that a test that hangs to its timeout costs them nothing.
STAGES=(preflight cuda_step_2s cuda_step_67ms pipeline hotswap tests cuda_step_500ms)
BLOCKED=  # why the stages that need the preflight are skipped
STAGE_PID=
CURRENT=

now() { date +%s%N; } # nanoseconds (integer arithmetic in bash; no awk needed)

# NAME KEY=VALUE...: a stage's status file (read by gpu_summary.py)
record() {
    local name=$1
    shift
    printf '%s\n' "$@" >"$OUT_DIR/stages/$name.status"
}

reap() {  # prints the pids it ended; grep runs without the mark (it would find itself)
    local file pid
    while IFS= read -r file; do
        pid=${file#/proc/}
        pid=${pid%/environ}
        [[ $pid == "$$" || $pid == "$BASHPID" ]] && continue
        kill -KILL "$pid" 2>/dev/null && printf '%s ' "$pid"
    done < <(env -u GPU_SH_RUN grep -lzx "GPU_SH_RUN=$RUN_ID" /proc/[0-9]*/environ 2>/dev/null)
}

summarize() {  # [--quiet]: summary.json from the status files and the stages' JSON; its exit: 0 when all is well
    "$PY" "$SUMMARY" summary "$OUT_DIR" --budget "$BUDGET" --elapsed "$SECONDS" "$@"
    local rc=$?
    if ((rc > 1)); then  # the summary itself broke (not "a stage failed"): a plain one, from bash
        fallback_summary "gpu_summary.py exited $rc"
    fi
    return $((rc > 0))
}

json_str() {  # a JSON string of $1 (backslashes, quotes, control characters)
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\n'/\\n}
    s=${s//$'\t'/ }
    printf '"%s"' "${s//[$'\001'-$'\037']/ }"
}

fallback_summary() {
    local name first=1 status rc
    {
        printf '{"summary_error": %s, "stages": {' "$(json_str "$1")"
        for name in "${STAGES[@]}"; do
            status=$(sed -n 's/^status=//p' "$OUT_DIR/stages/$name.status" 2>/dev/null)
            rc=$(sed -n 's/^rc=//p' "$OUT_DIR/stages/$name.status" 2>/dev/null)
            [[ $first ]] || printf ', '
            first=
            printf '%s: {"status": %s, "rc": %s}' "$(json_str "$name")" "$(json_str "${status:-unknown}")" "${rc:-null}"
        done
        printf '}}\n'
    } >"$OUT_DIR/summary.json"
}

# shellcheck disable=SC2329 # (called by the traps below)
on_signal() {  # this script was stopped (the machine's own limit, Ctrl-C): end the stage, say so, stop
    local sig=$1
    trap - TERM INT
    if [[ -n $STAGE_PID ]]; then
        kill -TERM "$STAGE_PID" 2>/dev/null
        wait "$STAGE_PID" 2>/dev/null
    fi
    reap >/dev/null
    if [[ -n $CURRENT ]]; then
        record "$CURRENT" "status=failed" "rc=null" "reason=interrupted by SIG$sig" "index=$(index_of "$CURRENT")"
    fi
    summarize
    rm -rf "$WORK"
    exit "$2"
}
trap 'on_signal TERM 143' TERM
trap 'on_signal INT 130' INT

index_of() {
    local i
    for i in "${!STAGES[@]}"; do [[ ${STAGES[$i]} == "$1" ]] && echo "$i" && return; done
    echo 99
}

selected() { [[ -z $ONLY || ",$ONLY," == *",$1,"* ]]; }

# NAME LIMIT_S CWD CMD...: CMD in CWD under timeout (LIMIT_S, cut to the time left), its output in
# logs/NAME.log; its status recorded whatever happens, and the run goes on
run_stage() {
    local name=$1 limit=$2 cwd=$3
    shift 3
    local index log="$OUT_DIR/logs/$name.log" left t0 t1 rc reaped status reason
    index=$(index_of "$name")
    { printf '%q ' "$@"; printf '\n'; } >"$OUT_DIR/stages/$name.cmd"
    if ! selected "$name"; then
        record "$name" "status=not_selected" "index=$index" "reason=not in GPU_SH_ONLY ($ONLY)"
        return 0
    fi
    if [[ -n $BLOCKED && $name != preflight ]]; then
        record "$name" "status=skipped" "index=$index" "reason=$BLOCKED"
        echo "-- $name: skipped ($BLOCKED)"
        return 0
    fi
    left=$((BUDGET - SECONDS - RESERVE_S))
    if ((left < MIN_STAGE_S)); then
        record "$name" "status=skipped" "index=$index" "timeout_s=$limit" \
            "reason=out of time: ${left} s left of the ${BUDGET} s budget"
        echo "-- $name: skipped (out of time: ${left} s left)"
        return 0
    fi
    ((limit > left)) && limit=$left
    if [[ $DRY == print ]]; then
        echo "-- $name (timeout ${limit} s, in $cwd): $(cat "$OUT_DIR/stages/$name.cmd")"
        record "$name" "status=printed" "index=$index" "timeout_s=$limit"
        return 0
    fi
    echo "-- $name (timeout ${limit} s) ..."
    record "$name" "status=running" "index=$index" "timeout_s=$limit" "started=$(date +%s)"
    CURRENT=$name
    t0=$(now)
    # in the background, so that a signal to this script is handled at once (a trap waits for a foreground child)
    (cd "$cwd" && exec timeout --kill-after=15 "$limit" "$@") >"$log" 2>&1 </dev/null &
    STAGE_PID=$!
    wait "$STAGE_PID"
    rc=$?
    t1=$(now)
    STAGE_PID=
    CURRENT=
    reaped=$(reap)
    case $rc in
        0) status=ok reason= ;;
        124 | 137) status=timeout reason="timed out after $limit s (exit $rc)" ;;
        *) status=failed reason="exit code $rc" ;;
    esac
    record "$name" "status=$status" "rc=$rc" "index=$index" "timeout_s=$limit" \
        "seconds=$(((t1 - t0) / 1000000000)).$((((t1 - t0) / 100000000) % 10))" "reason=$reason" \
        "reaped=${reaped% }"
    tail -n 3 "$log" | sed 's/^/   | /'
    summarize --quiet >/dev/null 2>&1  # after each stage: what has been measured survives a run cut short
    return 0
}

# ------------------------------------------------------------------------------------------------ the stages
for name in "${STAGES[@]}"; do
    record "$name" "status=pending" "index=$(index_of "$name")"
done
{
    echo "dry_run=${DRY:-0}"
    echo "budget_s=$BUDGET"
    echo "only=$ONLY"
    echo "started=$(date +%s)"
    echo "host=$(hostname 2>/dev/null)"
} >"$OUT_DIR/stages/RUN"
echo "gpu.sh: OUT=$OUT_DIR, budget ${BUDGET} s${DRY:+, dry run ($DRY)}"

run_stage preflight 60 "$REPO" bash "$SELF" __preflight "$OUT_DIR" "${DRY/print/}"
if grep -qxE "status=(failed|timeout)" "$OUT_DIR/stages/preflight.status"; then
    BLOCKED="the preflight failed (logs/preflight.log)"
fi

# cuda_step.py: 4 GB of parameters + AdamW state on the GPU, steps fitted to 2 s, 67 ms and 0.5 s by the rows
# per step; blocks of 3 steps with and without per-step snapshots, alternating, 2 of each (a per-step snapshot
# of the serial pipeline took ~2.4 s on an H100: each such step costs that). Auto (deferred acks) at 67 ms
# only, where its target is, in one block of each: its decision takes ~40 s of snapshot pairs, and a block at
# its interval is 3 intervals long (~150 steps each, expected: a snapshot's copy alone stalls a 67 ms step for
# 1.5 steps' time), ~30 s per block.
if [[ $DRY == 1 ]]; then  # tiny, on the CPU; auto decides after 9 steps, and at a budget it can keep here
    CUDA_STEP=(env "DP_SNAPSHOT_AUTO_STEPS=1,4" "$PY" benchmarks/cuda_step.py --device cpu --gb 0.005 --width 128
        --batch 32 --steps-per-block 2 --max-rows 64 --budget 0.5)
    STEP_2S=0.03 STEP_67MS=0.01 STEP_500MS=0.02 BLOCKS=1
else
    CUDA_STEP=("$PY" benchmarks/cuda_step.py --gb 4 --steps-per-block 3)
    STEP_2S=2 STEP_67MS=0.067 STEP_500MS=0.5 BLOCKS=2
fi
run_stage cuda_step_2s 130 "$REPO" "${CUDA_STEP[@]}" --blocks "$BLOCKS" --step-s "$STEP_2S" --no-auto \
    --json "$OUT_DIR/cuda_step_2s.json"
run_stage cuda_step_67ms 220 "$REPO" "${CUDA_STEP[@]}" --blocks 1 --step-s "$STEP_67MS" \
    --json "$OUT_DIR/cuda_step_67ms.json"

# The snapshot pipeline stage by stage (scaling.py part 1: copy, checksum, send; fetch, verify, load) against
# the device-to-host, host-to-device, memcpy and loopback TCP limits measured in the same run
if [[ $DRY == 1 ]]; then
    PIPELINE=(--device cpu --sizes 10 --reps 2)
else
    PIPELINE=(--device cuda --sizes "256,4000" --reps 3)
fi
run_stage pipeline 120 "$REPO" "$PY" benchmarks/scaling.py "${PIPELINE[@]}" --recovery-sizes "" \
    --json "$OUT_DIR/pipeline.json"

# One node + one spare on the GPU (dpstate.local_device(): both see it; the spare replaces the node, never
# trains beside it): examples/train_gpt.py with ~1.8 GB of state, every 4th step snapshotted, the node killed
# at step 25; the spare restores from its replica onto the GPU and trains to the end
mkdir -p "$OUT_DIR/hotswap"
if [[ $DRY == 1 ]]; then
    HOTSWAP_MODEL=(--n-layer 2 --n-embd 64 --n-head 2 --block-size 32 --batch-size 8)
    HOTSWAP_STEPS=16 HOTSWAP_KILL=8 HOTSWAP_INTERVAL=2
else
    HOTSWAP_MODEL=(--n-layer 12 --n-embd 1024 --n-head 16 --block-size 256 --batch-size 8)
    HOTSWAP_STEPS=40 HOTSWAP_KILL=25 HOTSWAP_INTERVAL=4
fi
run_stage hotswap 120 "$OUT_DIR/hotswap" env DP_SNAPSHOT_PROFILE="$OUT_DIR/hotswap/profile" \
    "$PY" -m dprun --nnodes 1 --spares 1 --no-tui --snapshot-interval "$HOTSWAP_INTERVAL" \
    --events-file events.jsonl --inject "kill-node:0@step=$HOTSWAP_KILL" \
    "$REPO/examples/train_gpt.py" --steps "$HOTSWAP_STEPS" --seed 0 "${HOTSWAP_MODEL[@]}" --log-every 10 \
    --summary summary.json --stats stats.json

# The CUDA tests: tests/test_cuda_gpu.py and the GPU test of tests/test_e2e_parallel.py (both skip without
# CUDA: in a dry run they are collected and skipped, which still checks the selection and the report)
TESTS=(tests/test_cuda_gpu.py "tests/test_e2e_parallel.py::test_a_one_node_job_on_the_gpu_hot_swaps_its_spare")
XDIST=()
if [[ $DRY != 1 && ${GPU_SH_TEST_WORKERS:-3} != 0 ]] && "$PY" -c "import xdist" >/dev/null 2>&1; then
    XDIST=(-n "${GPU_SH_TEST_WORKERS:-3}") # the hot swaps are mostly process start-up: they overlap well
fi
# (-o addopts=: this stage's options alone, whatever pyproject's addopts say)
run_stage tests 150 "$REPO" "$PY" -m pytest -o addopts= -v -rfEs -p no:cacheprovider --basetemp="$WORK/pytest" \
    --junitxml="$OUT_DIR/tests.junit.xml" ${XDIST[@]+"${XDIST[@]}"} "${TESTS[@]}"

run_stage cuda_step_500ms 100 "$REPO" "${CUDA_STEP[@]}" --blocks "$BLOCKS" --step-s "$STEP_500MS" --no-auto \
    --json "$OUT_DIR/cuda_step_500ms.json"

# ------------------------------------------------------------------------------------------------ the end
echo
summarize
rc=$?
rm -rf "$WORK"
exit "$rc"
