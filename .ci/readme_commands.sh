#!/usr/bin/env bash
# Run each Quick-start command of README.md verbatim, as a new user would: in
# the repository root, in its own new virtual environment, with an empty HOME
# (so an empty asset cache, pip cache and npm cache).
set -euo pipefail
commands="$(python3 .ci/readme_commands.py README.md)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
number=0
while IFS= read -r command; do
    number=$((number + 1))
    home="$work/home$number" venv="$work/venv$number"
    mkdir -p "$home"
    "${CI_PYTHON:-python3}" -m venv "$venv"
    echo "--- README command $number (HOME=$home): $command"
    start=$SECONDS
    env -u GENLM_BACKEND_CACHE -u HF_HOME -u HF_HUB_CACHE -u XDG_CACHE_HOME -u PIP_CACHE_DIR \
        -u npm_config_cache HOME="$home" VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
        bash -euo pipefail -c "$command"
    echo "--- README command $number passed in $((SECONDS - start)) s"
done <<< "$commands"
