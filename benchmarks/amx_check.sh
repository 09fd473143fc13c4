#!/usr/bin/env bash
# The AMX check: the CPU figures that matter on an Intel host with AMX, in one command.
#
#     bash benchmarks/amx_check.sh [OUT_DIR] [--quick]
#
# Run from the repository root, through the project's .venv. Prints the host's ISA line and whether
# the run is pinned (taskset -c 0,1 where taskset exists and there are two cores or more; always
# --threads 2), then runs, each writing its report to OUT_DIR (default benchmarks/results/amx_check)
# under the host's short name:
#   1. bench_cpu.py: the full-depth table (27 blocks, bf16, k25 against transformers; attention auto,
#      sdpa and, where it is installed, openvino);
#   2. profile_ops.py: where a block's time goes (depth 4, sdpa);
#   3. gemm_rates.py: the block's GEMMs alone against the same GEMMs inside the forward.
# It runs on any host; without AMX it says so, and its figures are not AMX ones.
# --quick: depth 4, one repeat, two packs (and a shorter profile and GEMM table), a smoke test.
set -euo pipefail

out=benchmarks/results/amx_check
quick=0
for arg in "$@"; do
    case "$arg" in
        --quick) quick=1 ;;
        -h | --help)
            sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        -*)
            echo "amx_check.sh: unknown option $arg (usage: bash benchmarks/amx_check.sh [OUT_DIR] [--quick])" >&2
            exit 2
            ;;
        *) out=$arg ;;
    esac
done

py=.venv/bin/python
if [[ ! -x $py || ! -f benchmarks/bench_cpu.py ]]; then
    echo "amx_check.sh: run it from the repository root, with the project's .venv in place" >&2
    exit 1
fi

host=$(hostname -s 2>/dev/null || hostname)
host=${host//[^A-Za-z0-9_-]/_}
amx=$(lscpu 2>/dev/null | grep -o 'amx[a-z_0-9]*' | sort -u | tr '\n' ' ' || true)
amx=${amx% }
echo "host: $($py -c 'import sys; sys.path.insert(0, "benchmarks"); from common import host_line; print(host_line())')"
if [[ -n $amx ]]; then
    echo "AMX: $amx"
else
    echo "AMX: no AMX (these figures are not AMX ones)"
fi

pin=()
if command -v taskset >/dev/null && [[ $(nproc) -ge 2 ]] && taskset -c 0,1 true 2>/dev/null; then
    pin=(taskset -c 0,1)
    echo "pinned: taskset -c 0,1, --threads 2"
else
    echo "not pinned (no taskset, fewer than 2 cores, or cores 0 and 1 not ours), --threads 2"
fi

attn=(auto sdpa)
if $py -c 'import openvino' 2>/dev/null; then
    attn+=(openvino)
else
    echo "OpenVINO not installed: --attn auto sdpa"
fi

if ((quick)); then
    tag=${host}_quick
    table=(--depth 4 --repeats 1 --packs '448x448 (32x32)' 'mixed 4')
    profile=(--depth 2 --reps 1 --packs '448x448 (32x32)')
    gemms=(--depth 2 --rows 256 1024 --reps 3)
else
    tag=$host
    table=(--depth 27 --repeats 2 --packs '448x448 (32x32)' 'mixed 4' '32 small (16x16)' '896x896 (64x64)')
    profile=(--depth 4 --reps 3)
    gemms=(--depth 4)
fi
mkdir -p "$out"
echo "reports: $out/*_$tag.md"
echo

run() {
    printf '$ python'
    printf ' %q' "$@"
    echo
    ${pin[@]+"${pin[@]}"} "$py" "$@"
    echo
}

run benchmarks/bench_cpu.py "${table[@]}" --threads 2 --towers k25 --dtypes bf16 --no-attention --no-extras \
    --no-llamacpp --no-widened --attn "${attn[@]}" --out "$out/bench_cpu_full_depth_$tag.md"
run benchmarks/profile_ops.py "${profile[@]}" --threads 2 --attn sdpa --out "$out/profile_ops_sdpa_$tag.md"
run benchmarks/gemm_rates.py "${gemms[@]}" --threads 2 --out "$out/gemm_rates_$tag.md"

echo "done: $out/bench_cpu_full_depth_$tag.md, $out/profile_ops_sdpa_$tag.md, $out/gemm_rates_$tag.md"
if [[ -z $amx ]]; then
    echo "no AMX on this host: these are not AMX figures"
fi
