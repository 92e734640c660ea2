#!/usr/bin/env bash
# One device run, about 1-3 minutes, never more than BUDGET (212) seconds: oneDNN 3.2 (PyPI onednn-cpu-gomp
# 2023.2.0, the project's) on the ResNet-50 backbone's convolutions exactly as kernels/native/onednn.cpp runs
# them (bench train: batch 2, 512 x 683, f32 / bf16 products / bf16; bench infer: batch 1, 800 x 1066), then
# PyTorch on the same convolutions (torch_convs.py); 2 threads pinned to 2 cores, as our users' machines.
#
#   bash bench/onednn_device/build.sh; xz -k -c .venv/lib/libdnnl.so.3 > bench/onednn_device/libdnnl.so.3.xz
#   OUT=/some/dir bash bench/onednn_device/run.sh     -> $OUT/onednn_device.log (OUT defaults to this folder)
# (the binary and the library are not committed: build them, then carry the folder to the device machine)
#
# Env: REPEATS (timed calls after a warm-up, default 5), MAX_S (seconds after which a call stops being
# repeated, at least 2 calls; default 1), CPUS (default 0,1; or cpu 0 and a cpu that is not its SMT sibling),
# PYTHON (default python3, else python), BUDGET (seconds for the whole, default 212).
# Needs: bash, coreutils timeout, xz (else Python's lzma), taskset (else unpinned, said so), glibc >= 2.17; torch for the last part.
set -u
KIT=$(cd "$(dirname "$0")" && pwd)
OUTDIR=$(mkdir -p "${OUT:-$KIT}" && cd "${OUT:-$KIT}" && pwd)
LOG=$OUTDIR/onednn_device.log
BUDGET=${BUDGET:-212}
START=$SECONDS
LIBDIR=$(mktemp -d "${TMPDIR:-/tmp}/onednn_scout.XXXXXX")
trap 'rm -rf "$LIBDIR"' EXIT

# stage CAP_SECONDS TITLE COMMAND...: COMMAND under timeout, at most CAP and never past the budget
stage() {
  local cap=$1 title=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  ((cap > left)) && cap=$left
  echo
  echo "######## $title  (timeout ${cap} s; $((SECONDS - START)) s elapsed)"
  if ((cap < 3)); then
    echo "SKIPPED: the ${BUDGET} s budget is spent"
    return
  fi
  timeout -k 3 "$cap" $PIN "$@"
  local rc=$?
  ((rc == 124 || rc == 137)) && echo "TIMED OUT after ${cap} s (the lines above are what it measured)"
  ((rc != 0 && rc != 124 && rc != 137)) && echo "FAILED: exit status $rc"
}

{
  echo "== onednn_scout $(date -u '+%Y-%m-%d %H:%M:%S UTC'); REPEATS=${REPEATS:-5} MAX_S=${MAX_S:-1} BUDGET=$BUDGET"
  echo "== cpu"
  lscpu | grep -E "^(Model name|Vendor ID|CPU\(s\)|On-line|Thread|Core|Socket|NUMA node\(s\)|CPU max MHz|CPU MHz|L1d|L2|L3|Hypervisor)"
  echo "flags: $(grep -m1 -o -w -E 'amx_bf16|amx_tile|amx_int8|amx_fp16|avx512_bf16|avx512_fp16|avx512f|avx512_vnni|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "kernel $(uname -r); $(ldd --version 2>&1 | head -1); memory $(free -g 2>/dev/null | awk '/Mem:/{print $2 " GiB"}')"
  [ -r /sys/fs/cgroup/cpu.max ] && echo "cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max)"

  # Python (torch's), and the two cores
  PY=${PYTHON:-python3}
  command -v "$PY" >/dev/null || PY=python
  if ! "$PY" -c "import torch" 2>/dev/null; then
    for candidate in python3 python; do "$candidate" -c "import torch" 2>/dev/null && PY=$candidate && break; done
  fi
  echo "python: $PY: $("$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__)" 2>&1 | tail -1)"
  if [ -z "${CPUS:-}" ]; then
    CPUS=$("$PY" - 2>/dev/null <<'EOF'
import os
allowed = sorted(os.sched_getaffinity(0))
def siblings(c):
    try:
        text = open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read().strip()
    except OSError:
        return {c}
    out = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out
first = 0 if 0 in allowed else allowed[0]
others = [c for c in allowed if c != first]
apart = [c for c in others if c not in siblings(first)]
second = 1 if 1 in apart else (apart or others or [first])[0]
print(f"{first},{second}")
EOF
)
    [ -n "$CPUS" ] || CPUS=0,1
  fi
  if command -v taskset >/dev/null; then
    PIN="taskset -c $CPUS"
  else
    PIN=""
    echo "WARNING: no taskset: unpinned (2 threads)"
  fi
  for c in ${CPUS//,/ }; do
    echo "cpu $c: SMT siblings $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null), core $(cat /sys/devices/system/cpu/cpu$c/topology/core_id 2>/dev/null), MHz $(awk -v n=$c '/^processor/{p=$3} /^cpu MHz/ && p==n {print $4}' /proc/cpuinfo)"
  done
  echo "pinned to: ${PIN:-nothing}"

  # oneDNN: the kit's libdnnl.so.3; libgomp.so.1 from the system, else the kit's, else torch's own copy
  export OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE  # as kernels/onednn.py sets it
  xz -dc "$KIT/libdnnl.so.3.xz" >"$LIBDIR/libdnnl.so.3" 2>/dev/null ||
    "$PY" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
      "$KIT/libdnnl.so.3.xz" "$LIBDIR/libdnnl.so.3"
  export LD_LIBRARY_PATH=$LIBDIR
  if ! "$KIT/bench" version >/dev/null 2>&1; then
    cp "$KIT/libgomp.so.1" "$LIBDIR/"
    if ! "$KIT/bench" version >/dev/null 2>&1; then
      gomp=$("$PY" -c "import torch, glob, os; d = os.path.dirname(torch.__file__); print((glob.glob(d + '/lib/libgomp*.so*') + glob.glob(d + '/../torch.libs/libgomp*.so*'))[0])" 2>/dev/null)
      [ -n "$gomp" ] && cp "$gomp" "$LIBDIR/libgomp.so.1" && echo "libgomp: torch's $gomp"
    fi
  fi
  echo "== ldd bench"
  ldd "$KIT/bench" | grep -E "dnnl|gomp|libc\.|libstdc|not found"
  "$KIT/bench" version

  cd "$KIT"
  stage 40 "oneDNN as onednn.cpp: train f32" ./bench train f32
  stage 25 "oneDNN as onednn.cpp: train bf16 products, f32 activations (inference precision mode)" ./bench train bf16p
  stage 25 "oneDNN as onednn.cpp: train bf16 activations and weights (train.precision bfloat16)" ./bench train bf16
  stage 25 "oneDNN as onednn.cpp: inference f32 and bf16 products" ./bench infer
  # torch as its users run it: its own OpenMP settings and libraries
  stage 70 "PyTorch reference: train" env -u LD_LIBRARY_PATH -u OMP_WAIT_POLICY "$PY" torch_convs.py train
  stage 25 "PyTorch reference: inference" env -u LD_LIBRARY_PATH -u OMP_WAIT_POLICY "$PY" torch_convs.py infer
  echo
  echo "== summary (ms, median per call x count, summed)"
  grep -h -E "^-- |TOTAL" "$LOG" 2>/dev/null
  echo "== done in $((SECONDS - START)) s"
} 2>&1 | tee "$LOG"
