#!/usr/bin/env bash
# Rebuilds ./bench from bench.cpp against the project venv's oneDNN 3.2 headers, for glibc >= 2.17 (zig's
# clang with its own static libc++: no libstdc++ or new-glibc symbols of ours; libdnnl.so.3 is found at run
# time through LD_LIBRARY_PATH). zig: pip install --target /tmp/ziglang ziglang (0.17.1 used).
# Without zig: g++ -O2 -std=c++17 -I$VENV/include bench.cpp -o bench -L$VENV/lib -l:libdnnl.so.3 (glibc/libstdc++ of this machine).
set -e
cd "$(dirname "$0")"
VENV=${VENV:-$(cd ../../.venv && pwd)}  # the repository's venv (bench/onednn_device or build/onednn_scout)
PYTHONPATH=${ZIG_PATH:-/tmp/ziglang} python3 -m ziglang c++ -target x86_64-linux-gnu.2.17 -O2 -std=c++17 \
  -I"$VENV/include" bench.cpp -o bench.full -L"$VENV/lib" -l:libdnnl.so.3
strip -o bench bench.full && rm bench.full
objdump -T bench | grep -o -E 'GLIBC_[0-9.]+' | sort -V -u | tail -1
