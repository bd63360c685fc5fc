# Step runner for .ci/run: `step NAME SCRIPT [ARGS...]` runs one step and
# records its status and wall time; `report` prints them and exits non-zero
# if any step failed.
CI_STEP_RESULTS=()
CI_FAILED=0

step() {
    local name="$1"; shift
    local start=$SECONDS status
    echo "::: step $name: $*"
    bash "$@"
    status=$?
    local seconds=$((SECONDS - start))
    [ "$status" -eq 0 ] || CI_FAILED=1
    CI_STEP_RESULTS+=("$(printf '%-18s %-6s %5d s' "$name" "$([ "$status" -eq 0 ] && echo ok || echo FAILED)" "$seconds")")
    echo "::: step $name: exit $status after $seconds s"
}

report() {
    echo "::: CI summary (total $SECONDS s)"
    printf '%s\n' "${CI_STEP_RESULTS[@]}"
    exit "$CI_FAILED"
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
