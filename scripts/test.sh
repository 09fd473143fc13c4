#!/usr/bin/env bash
# Set up .venv if needed, then run the lint and type gate and the whole test suite.
# Arguments go to pytest (e.g. `bash scripts/test.sh -k parity`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
