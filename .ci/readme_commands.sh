#!/usr/bin/env bash
# Run each Quick-start command of README.md verbatim, as a new user would: in
# the root of its own copy of the repository (as a fresh clone: the files git
# tracks, or would), in its own new virtual environment, with an empty HOME (so
# an empty asset cache, pip cache and npm cache). The commands share nothing, so
# they run side by side (much of each is download time); each one's output
# lines carry its number.
set -euo pipefail
commands="$(python3 .ci/readme_commands.py README.md)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

run_command() {
    local number="$1" command="$2"
    local home="$work/home$number" venv="$work/venv$number" repo="$work/repo$number"
    local start=$SECONDS
    mkdir -p "$home" "$repo"
    git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$repo"
    "${CI_PYTHON:-python3}" -m venv "$venv"
    echo "--- README command $number (in $repo, HOME=$home): $command"
    if (cd "$repo" && env -u GENLM_BACKEND_CACHE -u HF_HOME -u HF_HUB_CACHE -u XDG_CACHE_HOME -u PIP_CACHE_DIR \
        -u npm_config_cache HOME="$home" VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
        bash -euo pipefail -c "$command"); then
        echo "--- README command $number passed in $((SECONDS - start)) s"
    else
        local status=$?
        echo "--- README command $number FAILED (exit $status) after $((SECONDS - start)) s"
        return "$status"
    fi
}

pids=()
number=0
while IFS= read -r command; do
    number=$((number + 1))
    run_command "$number" "$command" 2>&1 | sed -u "s/^/[README $number] /" &
    pids+=($!)
done <<< "$commands"
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
exit "$status"
