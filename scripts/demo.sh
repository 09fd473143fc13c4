#!/usr/bin/env bash
# Set up .venv if needed, then run the main job on its built-in default.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m moonvit "$@"
