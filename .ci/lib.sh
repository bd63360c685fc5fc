# Step runner for .ci/run.
#
#   step NAME BUDGET_S SCRIPT [ARGS...]   run one step now; record its status, wall time, budget
#   lane NAME STEP_SPEC...                run steps one after another in the background, each
#                                         spec "NAME:BUDGET_S:SCRIPT"; lanes run side by side
#   wait_lanes                            wait for every lane
#   report                                print each step's status, time and budget; exit
#                                         non-zero if any step failed
#
# A step over its budget is reported ("OVER"), not failed: timings on a shared
# machine vary, and a red run must mean a broken build. The budgets say what each
# step may spend; a feature that needs more raises its step's budget in .ci/run.
CI_RESULTS="$(mktemp)"
CI_LANE_PIDS=()

step() {
    local name="$1" budget_s="$2"; shift 2
    local start=$SECONDS status
    echo "::: step $name (budget ${budget_s} s): $*"
    bash "$@"
    status=$?
    local seconds=$((SECONDS - start))
    printf '%s %s %s %s\n' "$name" "$status" "$seconds" "$budget_s" >> "$CI_RESULTS"
    echo "::: step $name: exit $status after $seconds s (budget $budget_s s)"
    return "$status"
}

lane() {
    local lane_name="$1"; shift
    (
        for spec in "$@"; do
            IFS=: read -r name budget_s script <<< "$spec"
            # Every line of the lane's output names its step: lanes interleave.
            step "$name" "$budget_s" "$script" 2>&1 | sed -u "s/^/[$name] /"
        done
    ) &
    CI_LANE_PIDS+=($!)
    echo "::: lane $lane_name started (pid $!): $*"
}

wait_lanes() {
    local pid
    for pid in "${CI_LANE_PIDS[@]}"; do
        wait "$pid"
    done
    CI_LANE_PIDS=()
}

report() {
    local failed=0 name status seconds budget_s verdict
    echo "::: CI summary (total $SECONDS s)"
    printf '%-18s %-7s %6s %8s\n' step status time budget
    while read -r name status seconds budget_s; do
        [ "$status" -eq 0 ] && verdict=ok || { verdict=FAILED; failed=1; }
        printf '%-18s %-7s %4d s %6d s%s\n' "$name" "$verdict" "$seconds" "$budget_s" \
            "$([ "$seconds" -gt "$budget_s" ] && echo '  OVER budget')"
    done < "$CI_RESULTS"
    rm -f "$CI_RESULTS"
    exit "$failed"
}


# For a step script: a throw-away venv in $work (removed when the script exits),
# activated, with the CPU build of torch installed first (any other torch spec
# pulls the CUDA wheels).
fresh_venv() {
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    "${CI_PYTHON:-python3}" -m venv "$work/venv"
    . "$work/venv/bin/activate"
    pip install -q torch==2.13.0
}
