#!/usr/bin/env bash
# Set up .venv if needed, then run the main job on its built-in default:
#   1. encode the built-in sample images with a random-init `small` encoder,
#      saving that encoder as a checkpoint folder and the images as PNG files;
#   2. export their visual tokens from that folder (python -m projector.export);
#   3. linear-probe a random-init `tiny` encoder on scikit-learn's digits.
# Arguments go to step 1 (`bash scripts/demo.sh --help` lists them); the demo sets
# --out, --save-checkpoint and --save-images itself. Each run replaces the output
# folder (outputs/demo, or $MOONVIT_DEMO_OUT) as a whole: the previous run's folder
# is moved aside first and put back if any step fails, so the folder always holds
# one complete run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

help=0
for arg in "$@"; do
    case "$arg" in
        -h | --help) help=1 ;;
        # with argparse's prefixes: --ou for --out, --save-c for --save-checkpoint, ...
        --o | --o=* | --ou | --ou=* | --out | --out=* | --sa | --sa=* | --sav | --sav=* | --save*)
            echo "demo.sh: ${arg%%=*} is set by the demo (its output folder is \$MOONVIT_DEMO_OUT," \
                "default outputs/demo); run python -m moonvit to choose it" >&2
            exit 2
            ;;
    esac
done

bash "$root/scripts/setup.sh"
cd "$root"
if [ "$help" = 1 ]; then
    echo "usage: bash scripts/demo.sh [python -m moonvit arguments]"
    echo
    echo "Encodes images (python -m moonvit), exports their tokens (python -m projector.export)"
    echo "and linear-probes a tiny encoder on digits (python -m eval.linear_probe), all into"
    echo "\${MOONVIT_DEMO_OUT:-outputs/demo}. The arguments below go to the first step."
    echo
    exec .venv/bin/python -m moonvit --help
fi

out="${MOONVIT_DEMO_OUT:-outputs/demo}"
previous="$out.previous"
rm -rf "$previous"
if [ -e "$out" ]; then
    mv "$out" "$previous"
fi
finish() {
    local status=$?
    if [ "$status" -ne 0 ]; then
        rm -rf "$out"
        if [ -e "$previous" ]; then
            mv "$previous" "$out"
            echo "demo.sh: a step failed; $out is left as the previous run wrote it" >&2
        fi
    fi
    exit "$status"
}
trap finish EXIT
trap 'exit 130' INT TERM

.venv/bin/python -m moonvit --out "$out" --save-checkpoint "$out/checkpoint" --save-images "$out/images" "$@"
.venv/bin/python -m projector.export --inputs "$out/images" --checkpoint "$out/checkpoint" --out "$out/export" \
    --store merged --shard-size 2
.venv/bin/python -m eval.linear_probe --preset tiny --random-init --dataset digits --out "$out/probe"
rm -rf "$previous"
