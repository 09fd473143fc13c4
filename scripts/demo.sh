#!/usr/bin/env bash
# Set up .venv if needed, then run the main job on its built-in default:
#   1. encode the built-in sample images with a random-init `small` encoder,
#      saving that encoder as a checkpoint folder and the images as PNG files;
#   2. export their visual tokens from that folder (python -m projector.export);
#   3. linear-probe a random-init `tiny` encoder on scikit-learn's digits.
# Arguments are passed to step 1 (python -m moonvit --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
out=outputs/demo
.venv/bin/python -m moonvit --out "$out" --save-checkpoint "$out/checkpoint" --save-images "$out/images" "$@"
.venv/bin/python -m projector.export --inputs "$out/images" --checkpoint "$out/checkpoint" --out "$out/export" \
    --store merged --shard-size 2
.venv/bin/python -m eval.linear_probe --preset tiny --random-init --dataset digits --out "$out/probe"
