#!/usr/bin/env bash
# Create or refresh the virtual environment at .venv in the repository root.
# Re-installs only when requirements-dev.txt or pyproject.toml changed. The project
# itself is installed in editable mode, so scripts and benchmarks import it from anywhere.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
stamp="$venv/.moonvit-installed"
want="$(cat "$root/requirements-dev.txt" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$root/requirements-dev.txt"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$root"
    echo "$want" > "$stamp"
fi
