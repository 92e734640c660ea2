#!/usr/bin/env bash
# One CPU kind's tables for bench/README.md: the scripts behind them, one after another, each writing into
# bench/results/cpu/KIND/, then bench/tables.py. Run it on a quiet machine (30-55 min on 2 cores):
#
#     bash bench/cpu_tables.sh zen4-avx512-bf16              # this CPU as it is
#     bash bench/cpu_tables.sh zen4-as-avx2 --as-avx2        # a newer CPU computing as an AVX2 one does
#
# --as-avx2 sets bench/common.py's AS_AVX2 for every side: oneDNN's kernels (ours and PyTorch's),
# OpenBLAS's, our attention kernel's, ATen's vector code and MKL's capped to AVX2.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: bash bench/cpu_tables.sh KIND [--as-avx2]}
if [ "${2:-}" = --as-avx2 ]; then
    export ONEDNN_MAX_CPU_ISA=AVX2 KERNELS_ATTENTION_ISA=1 OPENBLAS_CORETYPE=Haswell ATEN_CPU_CAPABILITY=avx2 \
        MKL_ENABLE_INSTRUCTIONS=AVX2
fi
out=bench/results/cpu/$kind
mkdir -p "$out"
python bench/model.py --train-size 512x683 --repeats 3 --output-dir "$out"
python bench/model.py --alternate 10 --train-size 512x683 --repeats 3 --output-dir "$out"  # the step's ratio, 10 pairs
python bench/deploy.py --repeats 3 --no-mlxfn --output-dir "$out"
python bench/attention.py --output "$out/attention_cpu.txt"
python bench/shape_memory.py --output "$out/shape_memory_cpu.txt"
python bench/conv_backward.py --output "$out/conv_backward_cpu.txt"
python bench/kept_weights.py --output "$out/kept_weights_cpu.txt"
python bench/tables.py
