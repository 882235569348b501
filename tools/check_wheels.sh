#!/usr/bin/env bash
# Builds the five wheels, installs each into an empty venv with pip (ttnpu dependencies from the
# freshly built wheels, the rest from the package index) and imports it there.
# Usage: bash tools/check_wheels.sh [package ...]   (default: all five)
set -euo pipefail
cd "$(dirname "$0")/.."
dist=$(mktemp -d)
trap 'rm -rf "$dist"' EXIT
uv build --all-packages --wheel -o "$dist" >/dev/null 2>&1
for name in "${@:-ft sdc routing dsv4 trainer}"; do
  for n in $name; do
    venv="$dist/venv-$n"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --find-links "$dist" "$dist"/ttnpu_"$n"-*.whl
    "$venv/bin/python" -c "import ttnpu.$n as m; print('ttnpu.$n', m.__version__, 'imports from', m.__file__)"
    rm -rf "$venv"
  done
done
